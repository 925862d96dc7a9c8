"""python -m mdlm_jax.plan --config=configs/NAME.py --mesh=fsdp=256 [--mesh=...] [--device-memory=80GiB]

Per-device memory of the train step on a mesh you do not have, before asking
for it. For each --mesh the model, the optimizer state and the batch are built
as abstract values (no array is ever allocated), and the real train step is
traced and lowered for that mesh on an AbstractMesh, which checks that every
sharding divides and that the step partitions. Then, per device:

  params, EMA, optimizer state, gradients: exact, from the sharded shapes;
  gathered weights and activations: analytic (what XLA holds at the peak,
    see `activation_bytes`), since XLA only compiles for devices it has.

With --compile the step is also compiled for the mesh on as many virtual CPU
devices, and XLA:CPU's buffer assignment (arguments, outputs, temporaries) is
printed beside the analytic figures: measured, but for the CPU's fusion and
scheduling decisions, not the accelerator's (XLA:CPU does not keep
rematerialisation: a plain jax.checkpoint chain compiles to the same
temporaries with and without it). Exits 1, naming the mesh and
the figures, when a plan does not fit --device-memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from mdlm_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (configs/NAME.py)")
_MESH = flags.DEFINE_multi_string("mesh", None, "target mesh, e.g. 'fsdp=256', 'data=4,fsdp=32,tensor=2' or 'fsdp=8,sequence=4'"
                                  " (repeat to compare several)")
_MEMORY = flags.DEFINE_string("device_memory", None, "memory per device, e.g. 80GiB, 95GB, 16GiB; a plan"
                              " that does not fit exits 1")
_BATCH = flags.DEFINE_integer("batch_size", None, "global batch (default: config.data.batch_size)")
_ACCUM = flags.DEFINE_integer("grad_accum", None, "micro-batches per step (default: config.optim.grad_accum_steps)")
_RULES = flags.DEFINE_enum("rules", None, ["fsdp", "fsdp_tp"], "sharding rules (default: config.sharding.rules)")
_PLATFORM = flags.DEFINE_enum("platform", "tpu", ["tpu", "cuda", "rocm", "cpu"], "platform to lower for")
_COMPILE = flags.DEFINE_bool("compile", False, "also compile on virtual CPU devices and print XLA's figures")
_SLOTS = flags.DEFINE_integer("serve_slots", 8, "serving: engine slots (requests decoded together)")
_CONTEXT = flags.DEFINE_integer("serve_context", None, "serving: tokens each slot holds (default: config.data.seq_len)")
_JSON = flags.DEFINE_bool("json", False, "print one JSON object per mesh instead of a table")
flags.mark_flags_as_required(["config", "mesh"])

GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str, flag: str = "--device_memory") -> int:
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
  if not m or m.group(2).lower() not in _UNITS:
    raise ValueError(f"{flag} must look like 80GiB, 95GB or 16e9 bytes, got {text!r}")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt(n: float) -> str:
  return f"{n / GiB:8.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):8.1f} MiB"


@dataclasses.dataclass
class Plan:
  mesh: dict
  devices: int
  rules: str
  batch: int
  micro_batch_per_device: int
  seq_len: int
  exact: dict  # bytes per device from sharded shapes
  analytic: dict  # bytes per device from the formula
  measured: dict | None = None  # XLA:CPU memory_analysis, when compiled
  lowered: bool = False
  serving: dict | None = None  # one device serving the model (`serving_memory`)

  @property
  def total(self) -> int:
    return sum(self.exact.values()) + sum(self.analytic.values())


def shard_bytes(sds) -> int:
  """Bytes one device holds of an abstract array with a NamedSharding."""
  shape = list(sds.shape)
  sizes = dict(sds.sharding.mesh.shape)
  for dim, axes in enumerate(sds.sharding.spec):
    for a in (axes,) if isinstance(axes, str) else (axes or ()):
      shape[dim] //= sizes[a]
  return math.prod(shape) * sds.dtype.itemsize


def tree_bytes(tree) -> int:
  import jax
  return sum(shard_bytes(x) for x in jax.tree.leaves(tree))


def _path_key(path) -> tuple:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def like_params(tree, params_abstract, mesh):
  """Shardings for an optimizer state: a leaf whose path ends with a
  parameter's path (Adam's mu and nu) is sharded as that parameter, the rest
  (step counts) is replicated, as jit propagates it from the params."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  by_path = {_path_key(p): x for p, x in jax.tree_util.tree_flatten_with_path(params_abstract)[0]}

  def one(path, leaf):
    key = _path_key(path)
    for start in range(len(key)):
      p = by_path.get(key[start:])
      if p is not None and p.shape == leaf.shape:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=p.sharding)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, P()))

  return jax.tree_util.tree_map_with_path(one, tree)


def activation_bytes(cfg, *, micro_batch: int, seq_len: int, sizes: dict, rules: str, layer_param_bytes: int,
                     params_sharded: bool) -> dict:
  """Peak activation memory of one device, from the shapes, assuming XLA frees
  what it no longer needs. A block keeps for its backward pass its q, k, v and
  attention output, the f32 attention probabilities (XLA's attention
  materialises them), the MLP pre-activations and hidden state, and its norm
  and residual values. With remat only each block's input is kept and the
  backward recomputes one block at a time; without it every block keeps all
  of that. The backward of one block holds its kept values, their gradients
  and the f32 gradients of both the scores and the probabilities. The logits
  are f32 (logits, log-softmax and their gradient). FSDP gathers one block's
  f32 weights at a time, twice over so the next gather overlaps."""
  import jax.numpy as jnp
  from mdlm_jax.model.precision import compute_dtype
  c = jnp.dtype(compute_dtype(cfg.dtype)).itemsize
  tp = sizes["tensor"] if rules == "fsdp_tp" else 1

  def split(n):  # a dim sharded over tensor when it divides
    return n // tp if n % tp == 0 else n

  # Sequence parallelism: each device holds L / sequence positions of every
  # activation, scores against all L keys and the gathered keys and values.
  seq = sizes.get("sequence", 1)
  b, L, d = micro_batch, seq_len // seq if seq_len % seq == 0 else seq_len, cfg.embed_dim
  h, hd, m, v = split(cfg.num_heads), cfg.resolved_head_dim, split(cfg.mlp_dim), split(cfg.vocab_size)
  n_mlp = 2 if cfg.mlp == "swiglu" else 1
  residual = b * L * d * c
  scores = b * h * L * seq_len * 4
  gathered_kv = 2 * b * (seq_len - L) * split(cfg.resolved_kv_heads) * hd * c
  kept = 4 * b * L * h * hd * c + scores + gathered_kv + (n_mlp + 1) * b * L * m * c + 4 * residual
  if cfg.remat:
    saved, backward = cfg.num_layers * residual, 2 * kept + scores
  else:
    saved, backward = cfg.num_layers * kept, kept + scores  # its kept values are already in `saved`
  out = {"activations kept for backward": saved, "backward of one block": backward,
         "logits (f32)": 3 * b * L * v * 4}
  if params_sharded:
    out["gathered weights (2 blocks, f32)"] = 2 * layer_param_bytes
  return out


def serving_memory(cfg, *, param_bytes: int, slots: int, context: int, weight_copies: int,
                   device_memory: int | None) -> dict:
  """The serving engine on one device: its weights (twice on CPU, where
  passes over a few slots read an [out, in] copy), and a KV cache of
  `context` tokens per slot (keys and values of every layer, in the compute
  dtype), and the longest context per slot that fits beside the weights with
  1 and with `slots` slots. A long prompt's prefill needs a workspace on top,
  linear in its length with the chunked attention (`bench longctx` measures it)."""
  from mdlm_jax.model.kv_cache import KVCache
  per_token = KVCache.bytes_per_token(cfg)
  out = {"slots": slots, "context": context, "weights": param_bytes * weight_copies,
         "kv_cache_bytes_per_token": per_token, "kv_cache": slots * context * per_token}
  if device_memory is not None:
    room = max(device_memory - out["weights"], 0)
    out["longest_context_1_slot"] = room // per_token
    out[f"longest_context_{slots}_slots"] = room // (slots * per_token)
  return out


def plan_one(config, mesh_sizes: dict, *, batch: int, accum: int, rules: str, platform: str,
             compile_: bool, serve_slots: int = 8, serve_context: int | None = None,
             device_memory: int | None = None) -> Plan:
  import jax
  import jax.numpy as jnp
  from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
  from mdlm_jax import config as config_lib
  from mdlm_jax.diffusion import objectives
  from mdlm_jax.parallel import sharding
  from mdlm_jax.training import trainer
  from mdlm_jax.model.spec import model_spec
  from mdlm_jax.model import ModelConfig
  mesh_sizes = {a: mesh_sizes.get(a, 1) for a in sharding.MESH_AXES}

  config = config.copy_and_resolve_references()
  config.mesh.update(mesh_sizes)
  config.data.batch_size, config.optim.grad_accum_steps = batch, accum
  config.sharding.rules = rules
  config_lib.validate(config)
  n = math.prod(mesh_sizes.values())
  shards = mesh_sizes["data"] * mesh_sizes["fsdp"]
  if batch % (shards * accum):
    raise config_lib.ConfigError(f"batch {batch} does not split into {accum} micro-batches over the {shards}"
                                 f" batch shards (data x fsdp) of mesh {mesh_sizes}")
  vocab = config.model.vocab_size if config.model.vocab_size > 0 else config.data.tokenizer_vocab_size
  cfg = ModelConfig.from_config(config.model, vocab_size=vocab)
  seq_len = config.data.seq_len
  if config.diffusion.block_size and config.objective == "mdlm":
    seq_len *= 2  # BD3-LM runs the network on [x_t ; x_0]

  axes = sharding.MESH_AXES
  abstract_mesh = AbstractMesh(tuple(mesh_sizes[a] for a in axes), axes, axis_types=(AxisType.Auto,) * len(axes))
  with sharding.axis_rules(sharding.RULES[rules]):
    spec = model_spec(cfg, abstract_mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          spec.abstract, spec.shardings)
    optimizer, _ = trainer.make_optimizer(config.optim, config.train.num_steps)
    opt_state = like_params(jax.eval_shape(optimizer.init, params), params, abstract_mesh)
    use_ema = config.optim.ema_decay > 0
    weights = {"params": params, **({"ema": params} if use_ema else {})}
    replicated = NamedSharding(abstract_mesh, P())
    train = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), "opt_state": opt_state}
    tokens = jax.ShapeDtypeStruct((batch, config.data.seq_len), jnp.int32,
                                  sharding=NamedSharding(abstract_mesh, sharding.logical_to_spec(("batch", None))))
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    objective = objectives.from_config(config, mask_id=vocab - 1)
    step = trainer.make_train_step(spec, objective, optimizer,
                                   trainer.StepConfig(accum, config.optim.ema_decay))
    shardings_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    jitted = jax.jit(step, out_shardings=(shardings_of(weights), shardings_of(train), None), donate_argnums=(0, 1))
    with jax.sharding.use_abstract_mesh(abstract_mesh):
      jitted.trace(weights, train, tokens, key).lower(lowering_platforms=(platform,))

    param_bytes = tree_bytes(params)
    exact = {"params (f32)": param_bytes}
    if use_ema:
      exact["EMA params"] = param_bytes
    exact["optimizer state"] = tree_bytes(opt_state)
    exact["gradients (f32)"] = param_bytes * (2 if accum > 1 else 1)  # + the accumulator
    exact["batch"] = shard_bytes(tokens)
    block0 = spec.abstract["blocks"][0]
    layer_params = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(block0))
    tp = mesh_sizes["tensor"] if rules == "fsdp_tp" else 1
    analytic = activation_bytes(cfg, micro_batch=batch // shards // accum, seq_len=seq_len, sizes=mesh_sizes,
                                rules=rules, layer_param_bytes=layer_params // tp,
                                params_sharded=mesh_sizes["fsdp"] > 1)
    measured = None
    if compile_:
      measured = _compile_on_cpu(jitted, weights, train, tokens, key, mesh_sizes, n)
  whole_params = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(spec.abstract))  # unsharded, f32
  serving = serving_memory(cfg, param_bytes=whole_params,
                           slots=serve_slots, context=serve_context or config.data.seq_len,
                           weight_copies=2 if platform == "cpu" else 1, device_memory=device_memory)
  return Plan(mesh_sizes, n, rules, batch, batch // shards // accum, seq_len, exact, analytic, measured, True,
              serving)


def _compile_on_cpu(jitted, weights, train, tokens, key, mesh_sizes, n) -> dict:
  """Compiles for n virtual CPU devices and returns XLA's buffer sizes per device."""
  import jax
  from jax.sharding import NamedSharding
  from mdlm_jax.parallel import sharding
  devices = jax.devices("cpu")
  if len(devices) < n:
    raise ValueError(f"--compile needs {n} CPU devices but this process has {len(devices)}: run plan as its own"
                     " process (it sets the device count before JAX starts)")
  mesh = sharding.make_mesh(mesh_sizes, devices[:n])
  concrete = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)), tree)
  args = [concrete(t) for t in (weights, train, tokens, key)]
  with jax.set_mesh(mesh):
    m = jitted.trace(*args).lower().compile().memory_analysis()
  return {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
          "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
          "generated code": m.generated_code_size_in_bytes}


def describe(p: Plan, device_memory: int | None) -> str:
  mesh = ", ".join(f"{a}={v}" for a, v in p.mesh.items())
  lines = [f"mesh {mesh} ({p.devices} devices, rules {p.rules}): batch {p.batch} x {p.seq_len} tokens,"
           f" {p.micro_batch_per_device} sequence(s) per device per micro-batch;"
           f" train step {'lowered' if p.lowered else 'not lowered'} for the abstract mesh",
           "  per device                              exact (sharded shapes)"]
  lines += [f"    {k:<36}{fmt(v)}" for k, v in p.exact.items()]
  lines.append("  per device                              analytic (see mdlm_jax/plan.py)")
  lines += [f"    {k:<36}{fmt(v)}" for k, v in p.analytic.items()]
  lines.append(f"  {'total':<38}{fmt(p.total)}" +
               (f"  of {fmt(device_memory).strip()}: {'fits' if p.total <= device_memory else 'DOES NOT FIT'}"
                if device_memory else ""))
  if p.measured:
    lines.append("  XLA:CPU compile for the same mesh (measured, but with the CPU's fusion and scheduling: it drops"
                 " remat and computes parts of bf16 in f32)")
    lines += [f"    {k:<36}{fmt(v)}" for k, v in p.measured.items()]
    peak = p.measured["arguments"] + p.measured["outputs"] - p.measured["aliased"] + p.measured["temporaries"]
    lines.append(f"    {'peak (args + outputs - aliased + temps)':<36}{fmt(peak)}")
  if p.serving:
    sv = p.serving
    lines.append(f"  serving on one device: {sv['slots']} slots x {sv['context']} tokens")
    lines.append(f"    {'weights':<36}{fmt(sv['weights'])}")
    lines.append(f"    {'KV cache':<36}{fmt(sv['kv_cache'])}  ({sv['kv_cache_bytes_per_token'] / 1024:.1f} KiB"
                 " per token)")
    if "longest_context_1_slot" in sv:
      many = sv[f"longest_context_{sv['slots']}_slots"]
      lines.append(f"    longest context per slot: {sv['longest_context_1_slot']:,} tokens with 1 slot, {many:,} with"
                   f" {sv['slots']} (KV cache beside the weights; a prefill's workspace comes on top)")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    cli.fail("plan", ValueError(f"unexpected arguments {argv[1:]}"))
  logging.set_verbosity(logging.WARNING)
  from mdlm_jax import config as config_lib
  try:
    meshes = [config_lib.parse_mesh(m) for m in _MESH.value]
    device_memory = parse_bytes(_MEMORY.value) if _MEMORY.value else None
    if _COMPILE.value:
      n = max(math.prod(m.values()) for m in meshes)
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                 f" --xla_force_host_platform_device_count={n}").strip()
    c = _CONFIG.value
    plans = [plan_one(c, m, batch=_BATCH.value or c.data.batch_size,
                      accum=_ACCUM.value or c.optim.grad_accum_steps,
                      rules=_RULES.value or c.sharding.rules,
                      platform=_PLATFORM.value, compile_=_COMPILE.value, serve_slots=_SLOTS.value,
                      serve_context=_CONTEXT.value, device_memory=device_memory) for m in meshes]
  except cli.USER_ERRORS as e:
    cli.fail("plan", e)
  for p in plans:
    if _JSON.value:
      print(json.dumps({**dataclasses.asdict(p), "total": p.total, "device_memory": device_memory,
                        "fits": None if device_memory is None else p.total <= device_memory}))
    else:
      print(describe(p, device_memory))
  over = [p for p in plans if device_memory is not None and p.total > device_memory]
  if over:
    worst = ", ".join(f"{','.join(f'{a}={v}' for a, v in p.mesh.items())} needs {fmt(p.total).strip()}"
                      for p in over)
    print(f"plan: error: does not fit {fmt(device_memory).strip()} per device: {worst}; use more devices,"
          " a smaller --batch_size, more --grad_accum micro-batches or model.remat=True", file=sys.stderr)
    sys.exit(1)


def parse_flags(argv):
  """absl flags, also spelled with dashes (--device-memory, --batch-size)."""
  dashed = ("device-memory", "batch-size", "grad-accum", "serve-slots", "serve-context")
  for i, arg in enumerate(argv):
    for name in dashed:
      if arg == f"--{name}" or arg.startswith(f"--{name}="):
        argv[i] = arg.replace(name, name.replace("-", "_"), 1)
  return app.parse_flags_with_usage(argv)

