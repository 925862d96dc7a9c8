"""The same train step on a 4-device mesh (data x tensor, and fsdp) equals the 1-device step."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mdlm_jax import diffusion
from mdlm_jax.diffusion import objectives
from mdlm_jax.parallel import sharding
from mdlm_jax.training import trainer
from mdlm_jax.model.spec import init_params, model_spec
from mdlm_jax.model import ModelConfig

CFG = ModelConfig(vocab_size=97, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64, time_conditioning=True,
                  cond_dim=16, tie_embeddings=False)


def mesh_of(data, fsdp, tensor, n):
  return sharding.make_mesh(ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor}),
                            jax.devices()[:n])


def run_steps(mesh, tokens, accum=1, n_steps=2, cfg=CFG, objective=None, rules="fsdp_tp"):
  optim = ml_collections.ConfigDict(dict(learning_rate=1e-2, warmup_steps=0, min_lr_ratio=0.1, weight_decay=0.1,
                                         b1=0.9, b2=0.98, eps=1e-5, grad_clip=1.0))
  objective = objective or objectives.MDLMObjective(diffusion.Schedule("loglinear", 1e-3), mask_id=3,
                                                   time_conditioning=True)
  with jax.set_mesh(mesh), sharding.axis_rules(sharding.RULES[rules]):
    spec = model_spec(cfg, mesh)
    params = init_params(spec, seed=7)
    shard_specs = {"wq": params["blocks"][0]["attn"]["wq"].sharding.spec, "head": params["head"].sharding.spec,
                   "w_up": params["blocks"][0]["mlp"]["w_up"].sharding.spec}
    optimizer, _ = trainer.make_optimizer(optim, 10)
    weights = {"params": params, "ema": jax.tree.map(jnp.copy, params)}
    state = {"step": jnp.zeros((), jnp.int32), "opt_state": jax.jit(optimizer.init)(params)}
    step = jax.jit(trainer.make_train_step(spec, objective, optimizer, trainer.StepConfig(accum, 0.9)))
    batch = jax.device_put(tokens, sharding.batch_sharding(mesh))
    losses = []
    for _ in range(n_steps):
      weights, state, m = step(weights, state, batch, jax.random.PRNGKey(0))
      losses.append(float(m["loss"]))
    return losses, jax.device_get(weights), shard_specs


_REF = {}


def single_device_reference(tokens):
  if "ref" not in _REF:
    _REF["ref"] = run_steps(mesh_of(1, 1, 1, 1), tokens)[:2]
  return _REF["ref"]


# Slow: the default run checks tensor parallelism on the tiny model below.
@pytest.mark.parametrize("layout", [pytest.param((2, 1, 2), marks=pytest.mark.slow),
                                    pytest.param((1, 2, 2), marks=pytest.mark.slow)])
def test_sharded_step_matches_single_device(layout):
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 host devices (tests/conftest.py sets XLA_FLAGS)")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (8, 16)), jnp.int32)
  ref_losses, ref_weights = single_device_reference(tokens)
  losses, weights, specs = run_steps(mesh_of(*layout, 4), tokens)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  # Adam divides by sqrt(v) + eps, which turns float reassociation noise in
  # near-zero gradients into update noise; eps=1e-5 bounds that well below lr.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), weights, ref_weights)
  # Parameters really are sharded by the logical rules: embed over fsdp, heads/vocab over tensor.
  assert specs["wq"] == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  # vocab 97 does not divide over tensor=2: that dimension stays replicated.
  assert specs["head"] == jax.sharding.PartitionSpec("fsdp", None)


@pytest.mark.slow  # the default rules' sharded step is checked by test_sharded_step_matches_single_device
@pytest.mark.parametrize("rules,layout", [("fsdp_tp", (1, 2, 2)), ("fsdp", (1, 4, 1))])
def test_named_rules_on_the_tiny_model_match_single_device(rules, layout):
  """configs/tiny.py's network (vocab 96, so the head shards over tensor too)
  trained under config.sharding.rules on 4 devices equals one device."""
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 host devices (tests/conftest.py sets XLA_FLAGS)")
  from tests.conftest import load_config
  cfg = ModelConfig.from_config(load_config("tiny").model, vocab_size=96)
  cfg = dataclasses.replace(cfg, tie_embeddings=False)
  objective = objectives.MDLMObjective(diffusion.Schedule("loglinear", 1e-3), mask_id=3, time_conditioning=False)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 96, (8, 16)), jnp.int32)
  ref_losses, ref_weights, _ = run_steps(mesh_of(1, 1, 1, 1), tokens, cfg=cfg, objective=objective)
  losses, weights, specs = run_steps(mesh_of(*layout, 4), tokens, cfg=cfg, objective=objective, rules=rules)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), weights, ref_weights)
  P = jax.sharding.PartitionSpec
  tensor = "tensor" if rules == "fsdp_tp" else None
  assert specs["wq"] == P("fsdp", tensor, None)
  assert specs["w_up"] == P("fsdp", tensor)
  assert specs["head"] == P("fsdp", tensor)


def test_fsdp_rules_refuse_a_tensor_axis(tiny_config):
  from mdlm_jax import config as config_lib
  tiny_config.sharding.rules = "fsdp"
  tiny_config.mesh.tensor = 2
  with pytest.raises(config_lib.ConfigError, match="mesh.tensor.*rules='fsdp'"):
    config_lib.validate(tiny_config)
  tiny_config.sharding.rules = "zero"
  with pytest.raises(config_lib.ConfigError, match="sharding.rules"):
    config_lib.validate(tiny_config)


@pytest.mark.slow
def test_grad_accumulation_matches_full_batch():
  """The AR loss is deterministic, so 2 micro-batches must reproduce the
  full-batch loss and update exactly (up to float reassociation)."""
  cfg = dataclasses.replace(CFG, causal=True, time_conditioning=False)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (8, 16)), jnp.int32)
  mesh = mesh_of(1, 1, 1, 1)
  ar = objectives.ARObjective()
  losses_acc, w_acc, _ = run_steps(mesh, tokens, accum=2, n_steps=2, cfg=cfg, objective=ar)
  losses_full, w_full, _ = run_steps(mesh, tokens, accum=1, n_steps=2, cfg=cfg, objective=ar)
  np.testing.assert_allclose(losses_acc, losses_full, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), w_acc, w_full)


def test_mesh_shape_errors():
  with pytest.raises(ValueError, match="does not divide"):
    sharding.mesh_shape({"data": 3, "fsdp": 1, "tensor": 1}, 4)
  with pytest.raises(ValueError, match="uses 2 devices but 4"):
    sharding.mesh_shape({"data": 2, "fsdp": 1, "tensor": 1}, 4)
  assert sharding.mesh_shape({"data": -1, "fsdp": 1, "tensor": 2}, 8) == {"data": 4, "fsdp": 1, "sequence": 1, "tensor": 2}


@pytest.mark.parametrize("rules", sorted(sharding.RULES))
def test_every_rules_table_names_every_logical_axis_of_a_gqa_model(rules):
  """A logical name missing from one table only fails on the meshes that use it,
  so every table must cover every name a model (GQA included) can carry."""
  from flax import nnx
  from mdlm_jax.model import Transformer
  cfg = ModelConfig(vocab_size=64, num_layers=1, embed_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
                    time_conditioning=True)
  state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  names = set()
  for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    names.update(n for n in (v.get_metadata().get("logical_axes") or ()) if n)
  table = dict(sharding.RULES[rules])
  assert names - set(table) == set()
  assert set(table) == set(dict(sharding.DEFAULT_RULES))  # activation names too
