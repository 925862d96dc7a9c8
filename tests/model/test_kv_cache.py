"""Transformer.forward_cached against the uncached forward: prefill + decode, block diffusion, padding, a mesh."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mdlm_jax.parallel import sharding
from mdlm_jax.model.spec import bind, model_spec
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.model import ModelConfig

BASE = dict(vocab_size=50, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64, cond_dim=16)
CAUSAL = (("causal", True),)
DIFFUSION = (("causal", False), ("time_conditioning", True), ("tie_embeddings", False))
SHIFTED = DIFFUSION + (("shift_logits", True),)
B, P = 2, 5
TOL = dict(rtol=1e-5, atol=1e-5)


def random_params(abstract, seed):
  """Numpy-drawn float32 params; adaLN modulation non-zero so that t matters."""
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    keys = [getattr(k, "key", None) for k in path]
    if keys[-1] == "embedding":
      w = rng.normal(size=x.shape)
    elif keys[-1] == "scale":
      w = 1.0 + 0.3 * rng.normal(size=x.shape)
    elif "modulation" in keys or "final_modulation" in keys or keys[-1] in ("b1", "b2"):
      w = 0.2 * rng.normal(size=x.shape)
    else:
      w = rng.normal(size=x.shape) / math.sqrt(x.shape[0] * x.shape[1] if keys[-1] == "wo" else x.shape[0])
    return jnp.asarray(w, jnp.float32)

  return jax.tree_util.tree_map_with_path(leaf, abstract)


@functools.lru_cache(maxsize=None)
def setup(kw):
  """(spec, params, full forward, cached forward, trace log), shared across tests to share compiles."""
  cfg = ModelConfig(**{**BASE, **dict(kw)})
  spec = model_spec(cfg, None)
  params = random_params(spec.abstract, 0)
  traces = []

  @jax.jit
  def full(params, tokens, positions, mask, t):
    return bind(spec, params)(tokens, t, positions, mask)

  @functools.partial(jax.jit, static_argnames="commit")
  def cached(params, tokens, positions, cache, valid_new, t, *, commit):
    traces.append((tokens.shape, commit))
    return bind(spec, params).forward_cached(tokens, positions, cache, commit=commit, valid_new=valid_new, t=t)

  return spec, params, full, cached, traces


def tokens_of(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(0, BASE["vocab_size"], size=shape), jnp.int32)


def arange_pos(b, start, n):
  return jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (b, n))


def left_padded(seed, length, n_real):
  """Rows of real tokens laid out two ways: right-aligned [b, length] (the unpadded reference: real
  tokens first, positions from 0, trailing junk hidden by causality or a mask) and a left-padded
  prompt [b, P] (junk pads marked invalid) with its positions, counting real tokens only."""
  real = np.asarray(tokens_of(seed, (B, length)))
  valid = np.arange(P)[None, :] >= (P - n_real)[:, None]
  prompt = np.full((B, P), 7, np.int32)
  for r in range(B):
    prompt[r, P - n_real[r]:] = real[r, :n_real[r]]
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  return real, jnp.asarray(prompt), jnp.asarray(valid), jnp.asarray(positions)


def block_causal_mask(n_real, block, n_blocks, length):
  """[b, 1, L, L] for right-aligned rows: row r's prefix (n_real[r] tokens) sees itself, its
  block j sees the prefix and blocks <= j; nobody sees the trailing junk."""
  masks = []
  for n in n_real:
    group = np.concatenate([np.zeros(n, int), 1 + np.repeat(np.arange(n_blocks), block)])
    group = np.concatenate([group, np.full(length - len(group), 10 ** 6)])  # junk: a group nobody reaches
    masks.append(group[None, :] <= group[:, None])
  return jnp.asarray(np.stack(masks)[:, None])


def rows(logits, n_real, lo, n):
  """Each row's logits at its own right-aligned positions [n_real[r] + lo, n_real[r] + lo + n)."""
  return np.stack([np.asarray(logits)[r, n_real[r] + lo:n_real[r] + lo + n] for r in range(B)])


def assert_same_cache(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_init_shapes_and_dtype():
  cfg = ModelConfig(**BASE, head_dim=6, dtype="bfloat16")
  c = KVCache.init(cfg, 3, 11)
  # Keys as [layer, row, head, dim, slot], values as [layer, row, head, slot, dim].
  assert c.k.shape == (2, 3, 4, 6, 11) and c.v.shape == (2, 3, 4, 11, 6) and c.k.dtype == jnp.bfloat16
  k, v = c.layer(1)
  assert k.shape == v.shape == (3, 11, 4, 6)
  assert c.valid.shape == (3, 11) and not np.any(c.valid) and int(c.length) == 0 and c.max_len == 11


N_REAL = np.array([P, 3])  # row 1: two invalid pad slots on the left


def test_causal_prefill_then_decode_matches_full_forward():
  """Left-padded prefill, then 4 single-token steps: every real token's logits equal the full
  causal forward of its row alone, and the jitted step (cache in, cache out) is traced once per shape."""
  spec, params, full, cached, traces = setup(CAUSAL)
  steps = 4
  real, prompt, valid, positions = left_padded(1, P + steps, N_REAL)
  ref = full(params, jnp.asarray(real), arange_pos(B, 0, P + steps), None, None)
  cache = KVCache.init(spec.cfg, B, P + steps + 2)  # spare slots must stay invisible
  n0 = len(traces)
  logits, cache = cached(params, prompt, positions, cache, valid, None, commit=True)
  for r in range(B):
    np.testing.assert_allclose(np.asarray(logits)[r, P - N_REAL[r]:], np.asarray(ref)[r, :N_REAL[r]], **TOL)
  for i in range(steps):
    tok = jnp.asarray(np.stack([real[r, N_REAL[r] + i] for r in range(B)])[:, None])
    pos = jnp.asarray(N_REAL[:, None] + i, jnp.int32)
    logits, cache = cached(params, tok, pos, cache, None, None, commit=True)
    assert logits.shape == (B, 1, BASE["vocab_size"]) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), rows(ref, N_REAL, i, 1), **TOL)
  assert int(cache.length) == P + steps
  np.testing.assert_array_equal(np.asarray(cache.valid), np.concatenate(
      [np.asarray(valid), np.ones((B, steps), bool), np.zeros((B, 2), bool)], axis=1))
  assert len(traces) - n0 == 2  # one prefill trace, one decode trace for all steps


@pytest.mark.parametrize("kw", [DIFFUSION, SHIFTED], ids=["plain", "shifted"])
def test_block_diffusion_cache_matches_block_causal_reference(kw):
  """A clean left-padded prefix, then 3 blocks of a time-conditioned bidirectional model: each
  block denoised with commit=False (cache untouched), then committed; every real token's logits
  equal the full forward of its row, [prefix; blocks], under the block-causal mask. A shifted
  head scores a block's first token from the cache's last state."""
  spec, params, full, cached, _ = setup(kw)
  first = 1 if spec.cfg.shift_logits else 0  # a left-padded prompt's first token is scored from a pad
  blk, n_blocks = 3, 3
  length = P + blk * n_blocks
  real, prompt, valid, positions = left_padded(2, length, N_REAL)
  t = jnp.asarray([0.3, 0.8], jnp.float32)
  mask = block_causal_mask(N_REAL, blk, n_blocks, length)
  ref = full(params, jnp.asarray(real), arange_pos(B, 0, length), mask, t)
  # t matters: the same input at another t differs.
  other = full(params, jnp.asarray(real), arange_pos(B, 0, length), mask, t[::-1])
  assert np.abs(np.asarray(other) - np.asarray(ref)).max() > 1e-3

  cache = KVCache.init(spec.cfg, B, length)
  logits, cache = cached(params, prompt, positions, cache, valid, t, commit=True)
  for r in range(B):
    np.testing.assert_allclose(np.asarray(logits)[r, P - N_REAL[r] + first:], np.asarray(ref)[r, first:N_REAL[r]],
                               **TOL)
  for j in range(n_blocks):
    lo = j * blk
    block = jnp.asarray(np.stack([real[r, N_REAL[r] + lo:N_REAL[r] + lo + blk] for r in range(B)]))
    pos = jnp.asarray(N_REAL[:, None] + lo + np.arange(blk)[None], jnp.int32)
    logits, same = cached(params, block, pos, cache, None, t, commit=False)
    np.testing.assert_allclose(np.asarray(logits), rows(ref, N_REAL, lo, blk), **TOL)
    assert_same_cache(same, cache)
    logits_commit, cache = cached(params, block, pos, cache, None, t, commit=True)
    np.testing.assert_allclose(np.asarray(logits_commit), np.asarray(logits), rtol=0, atol=1e-6)
    assert int(cache.length) == P + lo + blk


@pytest.mark.parametrize("kw,long", [(DIFFUSION, False), (SHIFTED, False), (DIFFUSION, True)],
                         ids=["plain", "shifted", "long-cache"])
def test_per_row_cache_matches_block_causal_reference(kw, long):
  """A serving-style cache: rows with prompts of different lengths (right-padded, each row
  committing only its own real tokens, so the rows' fill points differ), then blocks sent as
  [finished block | next block] chunks with new_block: the head is committed, the tail is
  denoised, and its logits equal the full forward under the block-causal mask. `long`: a
  cache past CHUNKED_CACHE_FROM slots (not a multiple of the tile), read in place by the
  chunked attention."""
  from mdlm_jax import kernels
  spec, params, full, _, _ = setup(kw)
  blk, n_blocks = 3, 3
  length = P + blk * n_blocks
  n_real = np.array([P, 2])
  real = np.asarray(tokens_of(4, (B, length)))
  t = jnp.asarray([0.4, 0.6], jnp.float32)
  ref = full(params, jnp.asarray(real), arange_pos(B, 0, length), block_causal_mask(n_real, blk, n_blocks, length), t)

  @functools.partial(jax.jit, static_argnames=("new_block",))
  def step(params, tokens, positions, cache, valid_new, keep, *, new_block):
    return bind(spec, params).forward_cached(tokens, positions, cache, commit=True, valid_new=valid_new, t=t,
                                             commit_len=keep, new_block=new_block)

  cache = KVCache.init(spec.cfg, B, kernels.CHUNKED_CACHE_FROM + 7 if long else P + 2 * blk * n_blocks, per_row=True)
  valid = jnp.asarray(np.arange(P)[None, :] < n_real[:, None])
  _, cache = step(params, jnp.asarray(real[:, :P]), arange_pos(B, 0, P), cache, valid, jnp.asarray(n_real), new_block=0)
  np.testing.assert_array_equal(np.asarray(cache.length), n_real)
  for j in range(n_blocks):
    idx = n_real[:, None] + j * blk + np.arange(-blk, blk)[None]  # [previous block | block j]
    chunk = jnp.asarray(np.take_along_axis(real, np.maximum(idx, 0), axis=1))
    head_valid = np.full((B, blk), j > 0)
    valid_new = jnp.asarray(np.concatenate([head_valid, np.ones((B, blk), bool)], axis=1))
    keep = jnp.full((B,), blk if j > 0 else 0, jnp.int32)
    logits, cache = step(params, chunk, jnp.asarray(np.maximum(idx, 0), jnp.int32), cache, valid_new, keep,
                         new_block=blk)
    assert logits.shape == (B, blk, BASE["vocab_size"])
    np.testing.assert_allclose(np.asarray(logits), rows(ref, n_real, j * blk, blk), **TOL)
    np.testing.assert_array_equal(np.asarray(cache.length), n_real + j * blk)
  with pytest.raises(ValueError, match="per-row cache"):
    KVCache.init(spec.cfg, B, 4).commit(jnp.zeros((B, 4), bool), jnp.ones((B,), jnp.int32))


def test_cache_under_mesh_matches_single_device():
  """With params sharded over a data x tensor mesh, the cache is sharded over batch and heads
  and the cached logits equal the uncached single-device forward."""
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 host devices (tests/conftest.py sets XLA_FLAGS)")
  spec0, params0, full, _, _ = setup(CAUSAL)
  tokens = tokens_of(4, (B, P + 4))  # the shape of the causal test's reference: no new compile
  ref = np.asarray(full(params0, tokens, arange_pos(B, 0, P + 4), None, None))
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 2, "fsdp": 1, "tensor": 2}), jax.devices()[:4])
  with jax.set_mesh(mesh):
    spec = model_spec(spec0.cfg, mesh)
    params = jax.device_put(params0, spec.shardings)

    @functools.partial(jax.jit, static_argnames="commit")
    def step(params, tokens, positions, cache, *, commit):
      return bind(spec, params).forward_cached(tokens, positions, cache, commit=commit)

    # One token per call (prefill included): one compile, which dominates this test.
    cache = KVCache.init(spec.cfg, B, P + 2)
    for pos in range(P + 2):
      logits, cache = step(params, tokens[:, pos:pos + 1], arange_pos(B, pos, 1), cache, commit=True)
      np.testing.assert_allclose(np.asarray(logits[:, 0]), ref[:, pos], **TOL)
    # Each device holds half the rows and half the heads of every layer.
    assert cache.k.sharding.shard_shape(cache.k.shape) == (2, 1, 2, 8, P + 2)
    assert cache.v.sharding.shard_shape(cache.v.shape) == (2, 1, 2, P + 2, 8)


@pytest.mark.parametrize("kw", [CAUSAL, SHIFTED], ids=["causal", "shifted"])
def test_last_only_is_the_last_column_without_the_others_logits(kw):
  """`last_only` gives the logits of the token after the prompt (same cache): the
  full call's last column, or with a shifted head the next pass's first column;
  the compiled prefill holds no [b, t, v] array: a long prompt batch's logits
  were its largest."""
  cfg = ModelConfig(**{**BASE, **dict(kw), "vocab_size": 4096})
  spec = model_spec(cfg, None)
  params = random_params(spec.abstract, int(np.random.default_rng().integers(1 << 30)))
  b, t = 4, 64
  tokens = jnp.asarray(np.random.default_rng().integers(0, 4096, size=(b, t)), jnp.int32)
  positions, cache = arange_pos(b, 0, t), KVCache.init(cfg, b, t + 1)
  time = jnp.full((b,), 0.5) if cfg.time_conditioning else None

  def prefill(params, last_only):
    return bind(spec, params).forward_cached(tokens, positions, cache, commit=True, t=time, last_only=last_only)

  full, full_cache = jax.jit(prefill, static_argnums=1)(params, False)
  last, last_cache = jax.jit(prefill, static_argnums=1)(params, True)
  assert last.shape == (b, 1, 4096)
  if cfg.shift_logits:  # the prompt's last state scores the next token, as the next pass's first column
    want, _ = bind(spec, params).forward_cached(tokens[:, :1], arange_pos(b, t, 1), full_cache, commit=False, t=time)
    want = np.asarray(want)[:, :1]
  else:
    want = np.asarray(full)[:, -1:]
  np.testing.assert_allclose(np.asarray(last), want, **TOL)
  assert_same_cache(full_cache, last_cache)
  # As an AR prefill uses it: the next token's logits, then whatever comes after.
  next_logits = jax.jit(lambda params, last_only: prefill(params, last_only)[0][:, -1], static_argnums=1)
  temp = next_logits.lower(params, True).compile().memory_analysis().temp_size_in_bytes
  logits_bytes = b * t * 4096 * 4
  assert temp < logits_bytes / 2, f"{temp} bytes of temporaries: the prompt's logits are still computed"


def test_a_clean_prefill_runs_no_adapters_and_keeps_the_same_cache():
  """`clean=True` (every new token kept): the same cache and next-token logits as
  the masked adapters give (they act on no kept token), without their products:
  NaN adapters leave it finite, and it equals the model with the adapters zeroed."""
  cfg = ModelConfig(**{**BASE, "causal": False, "clean_causal": True, "shift_logits": True,
                       "time_conditioning": False, "tie_embeddings": False, "lora_rank": 4})
  spec = model_spec(cfg, None)
  params = random_params(spec.abstract, int(np.random.default_rng().integers(1 << 30)))
  b, t = 3, 12
  rng = np.random.default_rng()
  tokens = jnp.asarray(rng.integers(0, BASE["vocab_size"], size=(b, t)), jnp.int32)
  valid = jnp.asarray(np.arange(t)[None] >= rng.integers(0, 4, size=(b, 1)))  # left padding
  positions, cache = arange_pos(b, 0, t), KVCache.init(cfg, b, t + 4)

  @functools.partial(jax.jit, static_argnums=1)
  def prefill(params, clean):
    return bind(spec, params).forward_cached(tokens, positions, cache, commit=True, valid_new=valid,
                                             last_only=True, clean=clean)

  masked, masked_cache = prefill(params, False)
  clean, clean_cache = prefill(params, True)
  np.testing.assert_array_equal(np.asarray(clean), np.asarray(masked))
  assert_same_cache(masked_cache, clean_cache)
  is_lora = lambda path: any("lora" in str(getattr(k, "key", "")) for k in path)  # noqa: E731
  nan = jax.tree_util.tree_map_with_path(lambda p, x: jnp.full_like(x, jnp.nan) if is_lora(p) else x, params)
  zero = jax.tree_util.tree_map_with_path(lambda p, x: jnp.zeros_like(x) if is_lora(p) else x, params)
  np.testing.assert_array_equal(np.asarray(prefill(nan, True)[0]), np.asarray(clean))
  np.testing.assert_array_equal(np.asarray(prefill(zero, False)[0]), np.asarray(clean))
  assert not np.all(np.isfinite(np.asarray(prefill(nan, False)[0])))  # the masked path does run them
  # The adapters do act on a token being denoised: a pass that keeps none of its tokens.
  noisy = lambda params: bind(spec, params).forward_cached(tokens, positions, cache, commit=True,  # noqa: E731
                                                           valid_new=valid, commit_len=0)[0]
  assert not np.allclose(np.asarray(noisy(params)), np.asarray(noisy(zero)))
  with pytest.raises(ValueError, match="commit=True"):
    bind(spec, params).forward_cached(tokens, positions, cache, commit=False, clean=True)
  with pytest.raises(ValueError, match="new_block=0"):
    bind(spec, params).forward_cached(tokens, positions, cache, commit=True, clean=True, new_block=2)
