"""The model with attention kernels on ("pallas_interpret") and off ("xla"): same loss, logits and samples."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mdlm_jax.diffusion import objectives
from mdlm_jax.diffusion import Schedule
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.sampling import rule
from mdlm_jax.sampling.samplers import Layout, ThresholdSampler, block_causal_mask
from tests.model.test_model import make, random_tokens

IMPLS = ("xla", "pallas_interpret")


def models(**kw):
  """The same parameters under both attention implementations."""
  return [make(seed=3, attention=impl, **kw) for impl in IMPLS]


def bd3_loss(model, grads: bool):
  x0 = jnp.asarray(random_tokens(4, b=2, l=8))
  obj = objectives.BD3Objective(Schedule("loglinear", 1e-3), 0, block_size=4)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def f(params):
    total, count = obj(nnx.merge(graphdef, params, rest), x0, jax.random.key(5))
    return total / count

  return jax.jit(jax.value_and_grad(f) if grads else f)(params)


def test_bd3_loss_same_with_kernels():
  ref, got = (bd3_loss(m, grads=False) for m in models(num_layers=1))
  assert float(got) == pytest.approx(float(ref), rel=1e-5)


@pytest.mark.slow
def test_bd3_gradients_same_with_kernels():
  (ref, g_ref), (got, g_got) = (bd3_loss(m, grads=True) for m in models())
  assert float(got) == pytest.approx(float(ref), rel=1e-5)
  for a, e in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-5)


def test_cached_block_logits_same_with_kernels():
  """A left-padded prompt and a block in one cached pass (the samplers' prefix mask)."""
  b, p, blk = 2, 6, 4
  toks = jnp.asarray(random_tokens(6, b=b, l=p + blk))
  valid = jnp.asarray(np.arange(p + blk)[None, :] >= np.array([[0], [2]]))  # row 1: two pad slots
  positions = jnp.broadcast_to(jnp.arange(p + blk, dtype=jnp.int32), (b, p + blk))
  out = []
  for model in models():
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state):
      m = nnx.merge(graphdef, state)
      return m.forward_cached(toks, positions, KVCache.init(m.cfg, b, 16), commit=True, valid_new=valid,
                              new_block=blk)

    out.append(f(state))
  (ref, ref_cache), (got, got_cache) = out
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(got_cache.valid), np.asarray(ref_cache.valid))


def test_block_causal_mask_is_the_dense_block_causal_mask():
  lay = Layout(gen_start=3, gen_len=10, mask_id=0, eos_id=1)
  valid = np.ones((2, 15), bool)
  valid[1, :2] = False
  got = np.asarray(block_causal_mask(jnp.asarray(valid), lay, 4).dense(15, 15))
  cols = np.arange(15)
  blk = np.where(cols < 3, -1, (cols - 3) // 4)
  blk = np.where(cols >= 13, np.iinfo(np.int32).max, blk)
  want = (blk[None, :] <= blk[:, None])[None] & valid[:, None, :]
  np.testing.assert_array_equal(got[:, 0], want)


def cached_samples(model, fused_head=False):
  """ThresholdSampler decoding block by block against a KV cache."""
  b, gs, gl, bs = 2, 4, 8, 4
  lay = Layout(gen_start=gs, gen_len=gl, mask_id=0, eos_id=1)
  prompt = random_tokens(7, b=b, l=gs)
  tokens = jnp.asarray(np.concatenate([prompt, np.zeros((b, gl), np.int32)], axis=1))
  valid = jnp.ones((b, gs + gl), bool)

  class Denoiser:
    positions = jnp.broadcast_to(jnp.arange(gs + gl, dtype=jnp.int32), (b, gs + gl))

    def cached(self, toks, pos, cache, commit, valid_new, commit_len=None, new_block=0, head=False):
      return model.forward_cached(toks, pos, cache, commit=commit, valid_new=valid_new, commit_len=commit_len,
                                  new_block=new_block, head=head)

    def new_cache(self, batch, max_len):
      return KVCache.init(model.cfg, batch, max_len)

  sampler = ThresholdSampler(block_size=bs, kv_cache=True, temperature=1.0, fused_head=fused_head)
  run = jax.jit(lambda tokens, keys: sampler.run(Denoiser(), tokens, valid, keys, lay, False, None)["tokens"])
  out = np.asarray(run(tokens, rule.row_keys(8 + jnp.arange(b))))
  assert (out[:, gs:gs + bs] != 0).all()  # the first block is always decoded
  return out


@pytest.mark.slow
def test_fused_head_sampling_on_cpu_equals_the_logits_path():
  """model.attention=pallas on CPU: attention and the fused head fall back; samples are unchanged."""
  model = make(seed=3, attention="pallas", num_layers=1)
  np.testing.assert_array_equal(cached_samples(model, fused_head=True), cached_samples(model))


@pytest.mark.slow
def test_cached_samples_same_with_kernels():
  ref, got = (cached_samples(m) for m in models())
  np.testing.assert_array_equal(got, ref)
