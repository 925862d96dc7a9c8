"""Mesh construction and the logical-axis rules that map names to mesh axes.

Parameters and activations are annotated with logical names ("embed", "mlp",
"batch", ...). One rules table turns those names into mesh axes, so the same
model runs on one CPU, a GPU node or a TPU pod by changing only `config.mesh`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "sequence", "tensor")

# Logical name -> mesh axis (or tuple of axes, or None = replicated), one
# table per strategy (config.sharding.rules). The batch always goes over data
# and fsdp together.
#
# "fsdp": ZeRO-3 style. Every weight is sharded over fsdp on its embed dim and
# gathered layer by layer inside the step; activations are sharded only by
# batch. The tensor axis carries nothing, so it must have size 1.
FSDP_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", "sequence"),  # sequence parallelism; size 1 unless config.mesh.sequence > 1
    ("embed", "fsdp"),
    ("heads", None),
    ("kv_heads", None),
    ("kv", None),
    ("mlp", None),
    ("vocab", None),
    ("cond", None),
    ("act_embed", None),
    ("act_heads", None),
    ("act_kv_heads", None),
    ("act_mlp", None),
    ("act_vocab", None),
)
# "fsdp_tp": FSDP plus Megatron-style tensor parallelism. Weights are also
# sharded over tensor on their heads/mlp/vocab dim, and so are the attention,
# MLP and logit activations; the residual stream stays whole within a tensor
# group (one all-reduce after attention and after the MLP).
FSDP_TP_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", "sequence"),  # sequence parallelism; size 1 unless config.mesh.sequence > 1
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),  # GQA key/value heads; dropped where they do not divide the tensor axis
    ("kv", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("cond", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)
RULES = {"fsdp": FSDP_RULES, "fsdp_tp": FSDP_TP_RULES}
DEFAULT_RULES = FSDP_TP_RULES  # with tensor=1 it is plain FSDP (or plain data parallelism with fsdp=1)


def rules_of(config) -> tuple:
  """The rules table a config names (config.sharding.rules; "fsdp_tp" when absent)."""
  name = config.sharding.rules
  if name not in RULES:
    raise ValueError(f"config.sharding.rules must be one of {sorted(RULES)}, got {name!r}")
  return RULES[name]


_rules = contextvars.ContextVar("mdlm_jax_axis_rules", default=DEFAULT_RULES)


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
  """Resolves -1 in the config to the devices left over; checks the product."""
  sizes = {a: int(mesh_cfg.get(a, 1)) for a in MESH_AXES}
  known = math.prod(v for v in sizes.values() if v != -1)
  if num_devices % known:
    raise ValueError(f"mesh {sizes} does not divide the {num_devices} available devices")
  for a, v in sizes.items():
    if v == -1:
      sizes[a] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(
        f"mesh {sizes} uses {math.prod(sizes.values())} devices but {num_devices} are available;"
        " set one axis to -1 to take the rest")
  return sizes


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  sizes = mesh_shape(mesh_cfg, len(devices))
  shape = tuple(sizes[a] for a in MESH_AXES)
  try:
    from jax.experimental import mesh_utils
    arr = mesh_utils.create_device_mesh(shape, devices=devices)
  except Exception:  # Topology-unaware fallback (e.g. CPU devices).
    arr = np.asarray(devices).reshape(shape)
  # Auto axes: XLA propagates shardings from the parameters, the batch and the
  # logical constraints in the model (GSPMD), as on every backend.
  return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def axis_rules(rules):
  token = _rules.set(tuple(rules))
  try:
    yield
  finally:
    _rules.reset(token)


def logical_to_spec(names: Sequence[str | None] | None, rules=None) -> P:
  """PartitionSpec for a tuple of logical names; a mesh axis is used once."""
  if names is None:
    return P()
  table = dict(rules if rules is not None else _rules.get())
  used: set[str] = set()
  out = []
  for name in names:
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no sharding rule")
    axes = table[name]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in used)
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def _current_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical names; a no-op outside a mesh context."""
  mesh = _current_mesh()
  if mesh is None:
    return x
  spec = fit_spec(logical_to_spec(names), x.shape, dict(mesh.shape))
  return jax.lax.with_sharding_constraint(x, spec)


def fit_spec(spec: P, shape, axis_sizes: dict[str, int]) -> P:
  """Drops mesh axes that do not divide the dimension they would shard."""
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    if axes is None:
      out.append(None)
      continue
    tup = (axes,) if isinstance(axes, str) else tuple(axes)
    kept = []
    size = 1
    for a in tup:
      if dim % (size * axis_sizes[a]) == 0:
        kept.append(a)
        size *= axis_sizes[a]
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return P(*out)


def param_shardings(state, mesh: Mesh):
  """NamedShardings for an nnx.State whose Variables carry `logical_axes` metadata."""
  from flax import nnx
  sizes = dict(mesh.shape)

  def one(v):
    names = v.get_metadata().get("logical_axes") if isinstance(v, nnx.Variable) else None
    spec = fit_spec(logical_to_spec(names), v.shape, sizes) if names else P()
    return NamedSharding(mesh, spec)

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1)))


def global_batch(batch: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host batch that every process holds in full, as one array sharded over
  the batch axes: each process places only the rows of its own devices, so it
  also works when the mesh spans several processes (device_put does not)."""
  sh = batch_sharding(mesh, batch.ndim)
  return jax.make_array_from_callback(batch.shape, sh, lambda index: batch[index])


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
