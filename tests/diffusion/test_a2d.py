"""An AR model adapted to block diffusion (A2D): a causal clean stream, a shifted head and
adapters on the noisy stream only. The block's first token is the base's prediction, whatever
the adapters hold; the KV-cached pass computes what the training pass computes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.diffusion import bd3
from mdlm_jax.model import ModelConfig
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.model.spec import bind, model_spec
from mdlm_jax.training import trainer

BASE = ModelConfig(vocab_size=48, num_layers=2, embed_dim=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
                   causal=True, tie_embeddings=True, scale_tied_logits=False)
A2D = dataclasses.replace(BASE, causal=False, shift_logits=True, clean_causal=True, lora_rank=4)
MASK = 47


def random_params(cfg, seed):
  """Every leaf random, the adapters' zero-initialised halves included (so they change the output)."""
  rng = np.random.default_rng(seed)
  spec = model_spec(cfg, None)

  def leaf(path, x):
    name = getattr(path[-1], "key", "")
    scale = 0.3 if name in ("scale", "a", "b") else 1.0 if name == "embedding" else x.shape[0] ** -0.5
    return jnp.asarray((1.0 if name == "scale" else 0.0) + scale * rng.normal(size=x.shape), jnp.float32)
  return spec, jax.tree_util.tree_map_with_path(leaf, spec.abstract)


def test_a_blocks_first_token_is_the_bases_prediction_whatever_the_adapters():
  spec, params = random_params(A2D, seed=0)
  base = {k: v for k, v in params.items() if k != "blocks"}
  base["blocks"] = {i: {part: {n: w for n, w in p.items() if not n.startswith("lora_")} for part, p in blk.items()}
                    for i, blk in params["blocks"].items()}
  rng = np.random.default_rng(1)
  x0 = jnp.asarray(rng.integers(0, MASK, (2, 12)))
  xt = jnp.where(jnp.asarray(rng.random((2, 12)) < 0.6), MASK, x0)
  block = 4
  got = np.asarray(bd3.block_logits(bind(spec, params), xt, x0, block))
  ar = np.asarray(bind(model_spec(BASE, None), base)(x0))  # ar[:, i] scores token i + 1
  starts = np.arange(block, 12, block)
  np.testing.assert_allclose(got[:, starts], ar[:, starts - 1], rtol=1e-5, atol=1e-5)
  # Inside a block the adapters and the right context count.
  assert np.abs(got[:, 1:block] - ar[:, :block - 1]).max() > 1e-2


def test_the_cached_pass_computes_the_training_pass():
  """Prefill the clean blocks before block j (no adapters, causal), then denoise block j:
  its logits equal those of the one [x_t ; x_0] training pass."""
  spec, params = random_params(A2D, seed=2)
  model = bind(spec, params)
  rng = np.random.default_rng(3)
  l, block = 12, 4
  x0 = jnp.asarray(rng.integers(0, MASK, (1, l)))
  xt = jnp.where(jnp.asarray(rng.random((1, l)) < 0.5), MASK, x0)
  want = np.asarray(bd3.block_logits(model, xt, x0, block))
  pos = jnp.arange(l)[None]
  for j in range(l // block):
    cache = KVCache.init(A2D, 1, l)
    lo, hi = j * block, (j + 1) * block
    if lo:
      _, cache = model.forward_cached(x0[:, :lo], pos[:, :lo], cache, commit=True)
    got, _ = model.forward_cached(xt[:, lo:hi], pos[:, lo:hi], cache, commit=False)
    if lo == 0:  # nothing before the first token: the training pass scores it from its own state
      got, want_j = got[:, 1:], want[:, 1:hi]
    else:
      want_j = want[:, lo:hi]
    np.testing.assert_allclose(np.asarray(got), want_j, rtol=1e-4, atol=1e-4)
  # A head (the finished block, kept) and the next block in one pass: the same numbers.
  cache = KVCache.init(A2D, 1, l)
  _, cache = model.forward_cached(x0[:, :4], pos[:, :4], cache, commit=True)
  got, _ = model.forward_cached(jnp.concatenate([x0[:, 4:8], xt[:, 8:12]], 1), pos[:, 4:12], cache, commit=True,
                                commit_len=4, new_block=4)
  np.testing.assert_allclose(np.asarray(got), want[:, 8:12], rtol=1e-4, atol=1e-4)


def test_adapter_only_steps_leave_the_base_untouched(tmp_path):
  spec, params = random_params(A2D, seed=4)
  trained, frozen = trainer.partition(params, adapters_only=True)
  assert all(trainer.is_adapter(p) for p, _ in jax.tree_util.tree_flatten_with_path(trained)[0])
  assert not any(trainer.is_adapter(p) for p, _ in jax.tree_util.tree_flatten_with_path(frozen)[0])
  back = trainer.combine(trained, frozen)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  with pytest.raises(Exception, match="'adapters' needs model.lora_rank"):
    from mdlm_jax import config as config_lib
    c = config_lib.base_config()
    c.train.trainable = "adapters"
    config_lib.validate(c)


def _two_pass_and_joint(seed):
  """(params, x_t, x_0, the two-pass logits function, the one-pass logits function) of a random adapted model."""
  from mdlm_jax import kernels
  spec, params = random_params(A2D, seed=seed)
  rng = np.random.default_rng(seed + 1)
  x0 = jnp.asarray(rng.integers(0, MASK, (2, 12)))
  xt = jnp.where(jnp.asarray(rng.random((2, 12)) < 0.5), MASK, x0)

  def joint(p):
    model = bind(spec, p)
    tokens = jnp.concatenate([xt, x0], axis=1)
    positions = jnp.broadcast_to(jnp.asarray(bd3.block_positions(12)), (2, 24))
    mask = kernels.AttentionMask(kind="block_diffusion_causal", block_size=4)
    hidden = model.hidden_states(tokens, None, positions, mask, noisy=jnp.broadcast_to(jnp.arange(24) < 12, (2, 24)))
    return model.logits(bd3.shifted_noisy_states(hidden, 4))

  return params, (lambda p: bd3.block_logits(bind(spec, p), xt, x0, 4)), joint


def test_the_two_pass_training_logits_equal_the_joint_pass():
  """The adapted model's training pass (clean stream alone under stop_gradient, then the
  noisy stream over its cache) gives the logits of one pass over [x_t ; x_0] with the
  causal-clean block mask."""
  params, two, joint = _two_pass_and_joint(5)
  np.testing.assert_allclose(np.asarray(two(params)), np.asarray(joint(params)), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # compiles two gradients (about 12 s on 2 cores)
def test_the_two_pass_adapter_gradients_equal_the_joint_pass():
  params, two, joint = _two_pass_and_joint(7)
  trained, frozen = trainer.partition(params, adapters_only=True)
  loss = lambda f: lambda t: jnp.sum(jax.nn.log_softmax(f(trainer.combine(t, frozen)))[..., 3])  # noqa: E731
  g2, gj = jax.grad(loss(two))(trained), jax.grad(loss(joint))(trained)
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(gj)):  # float32 sums in another order: to the gradient's scale
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=5e-5 * np.abs(np.asarray(b)).max())


def test_distillation_mixes_the_nelbo_with_the_kl_to_the_base():
  """Per-token terms against a float64 numpy reference: the teacher is the base AR model
  (its logits at i - 1 score token i), the weight the schedule's 1/t of the token's block."""
  from mdlm_jax import diffusion
  from mdlm_jax.diffusion import objectives
  spec, params = random_params(A2D, seed=4)
  model = bind(spec, params)
  base = {k: v for k, v in params.items() if k != "blocks"}
  base["blocks"] = {i: {part: {n: w for n, w in p.items() if not n.startswith("lora_")} for part, p in blk.items()}
                    for i, blk in params["blocks"].items()}
  rng = np.random.default_rng(5)
  l, block, lam = 12, 4, 0.3
  x0 = jnp.asarray(rng.integers(0, MASK, (2, l)))
  t = jnp.asarray(rng.uniform(0.2, 1.0, (2, l // block)), jnp.float32)
  key = jax.random.key(int(rng.integers(1 << 30)))
  schedule = diffusion.Schedule("loglinear", 1e-3)
  obj = objectives.BD3Objective(schedule=schedule, mask_id=MASK, block_size=block, distill_weight=lam)
  got = np.asarray(obj.per_token(model, x0, key, t))

  _, k_mask = jax.random.split(key)
  xt, masked = bd3.block_forward_mask(k_mask, x0, t, schedule, MASK)
  masked = np.asarray(masked)
  student = np.asarray(bd3.block_logits(model, xt, x0, block), np.float64)
  teacher = np.asarray(bind(model_spec(BASE, None), base)(x0), np.float64)
  teacher = np.concatenate([teacher[:, :1], teacher[:, :-1]], axis=1)  # row i scores token i
  student[..., MASK] = teacher[..., MASK] = -np.inf  # [MASK] is never a prediction

  def log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))
  with np.errstate(invalid="ignore"):  # -inf - -inf at [MASK], dropped below
    log_q, log_p = log_softmax(student), log_softmax(teacher)
    p = np.exp(log_p)
    kl = np.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
  nll = -np.take_along_axis(log_q, np.asarray(x0)[..., None], -1)[..., 0]
  w = np.repeat(1.0 / np.asarray(t, np.float64), block, axis=1)
  kl[:, 0] = 0.0
  want = np.where(masked, w * ((1 - lam) * nll + lam * kl), 0.0)
  assert masked.sum() > 4
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)

  plain = objectives.BD3Objective(schedule=schedule, mask_id=MASK, block_size=block)
  np.testing.assert_allclose(np.asarray(plain.per_token(model, x0, key, t)), np.where(masked, w * nll, 0.0),
                             rtol=2e-4, atol=2e-5)
  with pytest.raises(ValueError, match="distill_weight"):
    objectives.BD3Objective(schedule=schedule, mask_id=MASK, block_size=block, distill_weight=1.5)


def test_the_ar_loss_adds_the_bases_next_token_nll_on_the_scored_tokens():
  """ar_weight a: each scored token's term gains a * -log p_base(x_i | x_<i), against a float64 softmax
  of the plain causal model's logits (the clean stream, which adapters never touch)."""
  from mdlm_jax import diffusion
  from mdlm_jax.diffusion import objectives
  spec, params = random_params(A2D, seed=11)
  model = bind(spec, params)
  base = {k: v for k, v in params.items() if k != "blocks"}
  base["blocks"] = {i: {part: {n: w for n, w in p.items() if not n.startswith("lora_")} for part, p in blk.items()}
                    for i, blk in params["blocks"].items()}
  rng = np.random.default_rng()
  l, block, a = 12, 4, float(rng.uniform(0.2, 2.0))
  x0 = jnp.asarray(rng.integers(0, MASK, (2, l)))
  t = jnp.asarray(rng.uniform(0.2, 1.0, (2, l // block)), jnp.float32)
  loss_mask = jnp.asarray(rng.random((2, l)) < 0.7)
  key = jax.random.key(int(rng.integers(1 << 30)))
  schedule = diffusion.Schedule("loglinear", 1e-3)
  plain = objectives.BD3Objective(schedule=schedule, mask_id=MASK, block_size=block, frozen_base=False)
  with_ar = dataclasses.replace(plain, ar_weight=a)
  got = np.asarray(with_ar.per_token(model, x0, key, t, loss_mask=loss_mask), np.float64)
  nelbo = np.asarray(plain.per_token(model, x0, key, t, loss_mask=loss_mask), np.float64)
  z = np.asarray(bind(model_spec(BASE, None), base)(x0), np.float64)[:, :-1]  # row i - 1 predicts token i
  z = z - z.max(-1, keepdims=True)
  log_p = z - np.log(np.exp(z).sum(-1, keepdims=True))
  nll = -np.take_along_axis(log_p, np.asarray(x0)[:, 1:, None], -1)[..., 0]
  want = np.zeros_like(nelbo)
  want[:, 1:] = np.where(np.asarray(loss_mask)[:, 1:], a * nll, 0.0)
  np.testing.assert_allclose(got - nelbo, want, rtol=2e-4, atol=2e-5)
  with pytest.raises(ValueError, match="ar_weight"):
    objectives.BD3Objective(schedule=schedule, mask_id=MASK, block_size=block, ar_weight=0.5)  # a frozen base


@pytest.mark.slow  # compiles two gradients
def test_with_the_base_training_the_two_pass_gradients_equal_the_joint_pass():
  """clean_grad: every weight's gradient, the base's included, is the one [x_t ; x_0] pass's (the clean
  stream's keys and values carry gradient into the shared weights)."""
  spec, params = random_params(A2D, seed=9)
  rng = np.random.default_rng(10)
  x0 = jnp.asarray(rng.integers(0, MASK, (2, 12)))
  xt = jnp.where(jnp.asarray(rng.random((2, 12)) < 0.5), MASK, x0)
  _, _, joint = _two_pass_and_joint(9)
  two = lambda p: bd3.block_logits(bind(spec, p), xt, x0, 4, clean_grad=True)  # noqa: E731
  loss = lambda f: lambda p: jnp.sum(jax.nn.log_softmax(f(p))[..., 3])  # noqa: E731
  g2, gj = jax.grad(loss(two))(params), jax.grad(loss(joint))(params)
  frozen = jax.grad(loss(lambda p: bd3.block_logits(bind(spec, p), xt, x0, 4)))(params)
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(gj)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=5e-5 * np.abs(np.asarray(b)).max())
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(gj)))
