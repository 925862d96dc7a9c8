"""One train step's weights: the optimizer moves what is trained, the EMA averages it."""

import jax
import jax.numpy as jnp
import numpy as np

from mdlm_jax.diffusion import objectives
from mdlm_jax.model import ModelConfig
from mdlm_jax.model.spec import init_params, model_spec
from mdlm_jax.training import trainer
from tests.conftest import load_config


def test_an_adapter_step_averages_the_adapters_and_carries_frozen_weights_exactly():
  c = load_config("tiny")
  c.objective, c.diffusion.block_size = "mdlm", 4
  c.model.update(causal=False, shift_logits=True, clean_causal=True, lora_rank=2, num_layers=1)
  c.optim.update(warmup_steps=0, learning_rate=1e-2)
  spec = model_spec(ModelConfig.from_config(c.model, vocab_size=97), None)
  params = init_params(spec, seed=3)
  rng = np.random.default_rng()
  # Weights an EMA of d * p + (1 - d) * p would round: random, with many mantissa bits set.
  params = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 0.1, p.dtype), params)
  optimizer, _ = trainer.make_optimizer(c.optim, 10)
  trained, _ = trainer.partition(params, True)
  state = {"step": jnp.asarray(5, jnp.int32), "opt_state": optimizer.init(trained)}
  ema = jax.tree.map(lambda p: p + jnp.asarray(rng.standard_normal(p.shape) * 0.01, p.dtype), params)
  objective = objectives.from_config(c, 3, training=True)
  step = jax.jit(trainer.make_train_step(spec, objective, optimizer, trainer.StepConfig(1, 0.9, adapters_only=True)))
  tokens = jnp.asarray(rng.integers(4, 97, size=(2, 16)), jnp.int32)
  out, _, _ = step({"params": params, "ema": ema}, state, tokens, jax.random.PRNGKey(0))
  d = float(trainer.ema_decay_at(0.9, jnp.float32(5)))
  flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
  before, ema_before, after, ema_after = flat(params), flat(ema), flat(out["params"]), flat(out["ema"])
  adapters = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0] if trainer.is_adapter(k)}
  assert adapters and len(adapters) < len(before)
  moved = 0
  for name, p in before.items():
    if name in adapters:
      want = d * ema_before[name].astype(np.float64) + (1 - d) * after[name].astype(np.float64)
      np.testing.assert_allclose(ema_after[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
      moved += not np.array_equal(after[name], p)
    else:  # frozen: the weights and their average are the base's, bit for bit
      np.testing.assert_array_equal(after[name], p, err_msg=name)
      np.testing.assert_array_equal(ema_after[name], p, err_msg=name)
  assert moved > 0
