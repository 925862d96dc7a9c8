"""Sequence parallelism: the sequence split over a 4-device `sequence` axis
gives the one-device attention, loss and update (MDLM, AR and BD3-LM)."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mdlm_jax import diffusion, kernels
from mdlm_jax.diffusion import objectives
from mdlm_jax.parallel import sharding
from tests.kernels.test_attention_kernels import fresh_seed, make_mask, rand_inputs
from tests.parallel.test_sharding import CFG, run_steps

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 host devices (tests/conftest.py sets XLA_FLAGS)")


def mesh_of(**sizes):
  n = int(np.prod(list(sizes.values())))
  return sharding.make_mesh(ml_collections.ConfigDict(sizes), jax.devices()[:n])


# By default the BD3 training mask and a KV-cache prefix (the kinds with per-row arrays or blocks).
@pytest.mark.parametrize("kind,dims", [pytest.param("full", (2, 16, 16, 4, 2, 8), marks=pytest.mark.slow),
                                       pytest.param("causal", (1, 16, 40, 4, 2, 8), marks=pytest.mark.slow),
                                       ("block_diffusion", (2, 32, 32, 2, 1, 8)),
                                       ("prefix", (2, 8, 24, 2, 2, 8)),
                                       pytest.param("segments", (2, 24, 24, 4, 4, 8), marks=pytest.mark.slow)])
def test_attention_over_a_split_sequence_matches_the_reference(kind, dims):
  """Output and gradients of every mask kind on a (sequence=4) mesh, and on
  (data=2, sequence=2), against the reference on one device."""
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  b, l, s, h, g, d = dims
  q, k, v, r = rand_inputs(rng, b, l, s, h, g, d, jnp.float32)
  mask = make_mask(kind, rng, b, l, s)
  has_key = np.asarray(jnp.broadcast_to(mask.dense(l, s), (b, 1, l, s))).any(-1)[:, 0]
  r = r * jnp.asarray(has_key, jnp.float32)[:, :, None, None]

  def value_and_grads(attend):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v) * r)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  want = value_and_grads(lambda q, k, v: kernels.attention_reference(q, k, v, mask=mask))
  # The loss sums many signed terms and can land near zero: float32 sums err
  # relative to the sum of the terms' magnitudes, not to the sum.
  loss_atol = 1e-5 * float(jnp.sum(jnp.abs(kernels.attention_reference(q, k, v, mask=mask) * r)))
  for layout in ({"sequence": 4}, {"data": 2, "sequence": 2}):
    mesh = mesh_of(**layout)
    with jax.set_mesh(mesh):
      got = value_and_grads(lambda q, k, v: kernels.attention(q, k, v, mask=mask))
      split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))
      hlo = jax.jit(lambda q, k, v: kernels.attention(q, k, v, mask=mask)).lower(
          *(jax.device_put(x, split) for x in (q, k, v))).compile().as_text()
    # Keys and values move between the sequence shards (gathered, or regrouped with the batch split).
    assert any(op in hlo for op in ("all-gather", "all-to-all", "collective-permute")), layout
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=loss_atol, err_msg=f"loss, {layout}, seed {seed}")
    for name, a, e in zip("qkv", got[1], want[1]):
      np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5, err_msg=f"d{name}, {layout}, seed {seed}")


def _mdlm():
  return objectives.MDLMObjective(diffusion.Schedule("loglinear", 1e-3), mask_id=3, time_conditioning=True)


# Each objective (BD3-LM: its [x_t ; x_0] sequence and mask split mid-block) trains
# a step on one device and on a split sequence: slow, run with -m slow. The
# attention tests above keep the split itself in the default run.
@pytest.mark.parametrize("name", [pytest.param("mdlm", marks=pytest.mark.slow), pytest.param("ar", marks=pytest.mark.slow),
                                  pytest.param("bd3", marks=pytest.mark.slow)])
def test_training_with_a_split_sequence_matches_one_device(name):
  cfg, objective = CFG, _mdlm()
  if name == "ar":
    cfg, objective = dataclasses.replace(CFG, causal=True, time_conditioning=False), objectives.ARObjective()
  elif name == "bd3":
    cfg = dataclasses.replace(CFG, time_conditioning=False)
    objective = objectives.BD3Objective(diffusion.Schedule("loglinear", 1e-3), mask_id=3, time_conditioning=False,
                                        block_size=4)
  tokens = jnp.asarray(np.random.default_rng(fresh_seed()).integers(0, 97, (4, 16)), jnp.int32)
  ref_losses, ref_weights, _ = run_steps(mesh_of(data=1), tokens, cfg=cfg, objective=objective)
  losses, weights, _ = run_steps(mesh_of(data=2, sequence=2) if name == "ar" else mesh_of(sequence=4), tokens,
                                 cfg=cfg, objective=objective)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), weights, ref_weights)


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_activations_are_split_along_the_sequence():
  """The residual stream inside the step is sharded over the sequence axis."""
  from mdlm_jax.model import Transformer
  from flax import nnx
  mesh = mesh_of(sequence=4)
  with jax.set_mesh(mesh), sharding.axis_rules(sharding.DEFAULT_RULES):
    model = Transformer(dataclasses.replace(CFG, time_conditioning=False), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 16), jnp.int32)
    hlo = jax.jit(lambda t: model(t)).lower(tokens).compile().as_text()
  assert "all-gather" in hlo
  assert sharding.logical_to_spec(("batch", "length", "act_embed")) == jax.sharding.PartitionSpec(
      ("data", "fsdp"), "sequence", None)


def test_mesh_sequence_must_divide_the_sequence(tiny_config):
  from mdlm_jax import config as config_lib
  tiny_config.mesh.sequence = 3
  with pytest.raises(config_lib.ConfigError, match="mesh.sequence.*seq_len"):
    config_lib.validate(tiny_config)
  assert config_lib.parse_mesh("data=2,sequence=2") == {"data": 2, "fsdp": 1, "sequence": 2, "tensor": 1}
