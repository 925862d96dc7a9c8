"""Chunked online-softmax attention (plain JAX, memory linear in length)
against the reference for every mask kind, forward and backward, and against
a float64 numpy softmax; on fresh random inputs (the seed is in failures)."""

import importlib
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import kernels
from mdlm_jax.kernels import AttentionMask
from mdlm_jax.kernels.chunked_attention import chunked_attention
from tests.kernels.test_attention_kernels import CASES, compare, fresh_seed, make_mask, rand_inputs


def _chunked(block_q, block_k):
  return lambda q, k, v, mask: chunked_attention(q, k, v, mask, block_q=block_q, block_k=block_k)


# By default the kinds with structure to skip; every kind with -m slow.
@pytest.mark.parametrize("kind,dims", [c if c[0] in ("causal", "block_diffusion", "prefix") else
                                       pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
                         ids=[c[0] for c in CASES])
def test_every_mask_kind_matches_the_reference(kind, dims):
  """Tiles of 8 x 16 over lengths they do not divide: ragged last tiles."""
  compare(kind, dims, jnp.float32, impl=_chunked(8, 16))


@pytest.mark.slow
def test_bfloat16_matches_the_reference():
  compare("causal", (2, 33, 33, 2, 1, 16), jnp.bfloat16, impl=_chunked(16, 8))


@pytest.mark.parametrize("kind", ["causal", "prefix", "segments"])
def test_forward_equals_a_float64_softmax(kind):
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  b, l, s, h, g, d = 2, 19, 19 if kind != "prefix" else 45, 4, 2, 8
  q, k, v, _ = rand_inputs(rng, b, l, s, h, g, d, jnp.float32)
  mask = make_mask(kind, rng, b, l, s)
  allowed = np.broadcast_to(np.asarray(mask.dense(l, s)), (b, 1, l, s))[:, 0]  # [b, l, s]
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  k64, v64 = np.repeat(k64, h // g, axis=2), np.repeat(v64, h // g, axis=2)  # GQA: kv head j serves h/g query heads
  scores = np.einsum("blhd,bshd->bhls", q64, k64) / np.sqrt(d)
  scores = np.where(allowed[:, None], scores, -np.inf)
  has_key = allowed.any(-1)  # [b, l]
  scores = np.where(has_key[:, None, :, None], scores, 0.0)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  want = np.einsum("bhls,bshd->blhd", p / p.sum(-1, keepdims=True), v64) * has_key[:, :, None, None]
  got = np.asarray(jax.jit(lambda q, k, v: chunked_attention(q, k, v, mask, block_q=8, block_k=8))(q, k, v))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")


def test_a_row_reading_nothing_is_zero_with_zero_gradients():
  """As from the kernels; finite everywhere (no 0/0 from an empty softmax)."""
  _, k, v, _ = rand_inputs(np.random.default_rng(fresh_seed()), 1, 3, 5, 2, 2, 8, jnp.float32)
  q = k[:, :3]
  mask = AttentionMask(kind="prefix", q_end=jnp.asarray([[0, 2, 5]], jnp.int32), kv_valid=jnp.ones((1, 5), bool))
  run = lambda q, k, v: chunked_attention(q, k, v, mask, block_q=2, block_k=2)  # noqa: E731  (a tile past the keys)
  out = np.asarray(run(q, k, v))
  assert np.all(out[0, 0] == 0.0) and np.isfinite(out).all()
  np.testing.assert_allclose(out[0, 1:], np.asarray(kernels.attention_reference(q, k, v, mask=mask))[0, 1:],
                             rtol=1e-6, atol=1e-6)
  grads = jax.grad(lambda q, k, v: run(q, k, v)[0, 0].sum(), argnums=(0, 1, 2))(q, k, v)
  assert all(np.all(np.asarray(g) == 0.0) for g in grads)


@pytest.mark.parametrize("kind", ["block_diffusion", "segments"])
def test_tiles_with_no_readable_key_are_skipped(kind, monkeypatch):
  """Scores are computed for exactly the tiles whose dense mask allows some
  key: a BD3 noisy tile's later noisy tiles and other documents' tiles,
  inside a query tile's key range, cost nothing. Counted without jit, where
  `lax.cond` runs only the branch it takes."""
  module = importlib.import_module(chunked_attention.__module__)
  rng = np.random.default_rng(fresh_seed())
  tile = 8
  if kind == "block_diffusion":
    mask = AttentionMask(kind="block_diffusion", block_size=4)
    l = 48
  else:
    l = 40
    cuts = np.sort(rng.choice(np.arange(1, l), 3, replace=False))
    seg = jnp.asarray(np.searchsorted(cuts, np.arange(l), side="right")[None], jnp.int32)
    mask = AttentionMask(kind="causal", q_segment_ids=seg, kv_segment_ids=seg)
  q, k, v, _ = rand_inputs(rng, 1, l, l, 2, 2, 8, jnp.float32)
  dense = np.asarray(mask.dense(l, l))[0, 0]
  nonempty = dense.reshape(l // tile, tile, l // tile, tile).any((1, 3)).sum()
  calls = []
  scores = module._scores
  monkeypatch.setattr(module, "_scores", lambda *a, **kw: calls.append(1) or scores(*a, **kw))
  with jax.disable_jit():
    out = chunked_attention(q, k, v, mask, block_q=tile, block_k=tile)
  assert len(calls) == nonempty < (l // tile) ** 2
  np.testing.assert_allclose(np.asarray(out), np.asarray(kernels.attention_reference(q, k, v, mask=mask)),
                             rtol=1e-5, atol=1e-5)


def test_backward_keeps_no_score_matrix():
  """The saved residuals of a 4096-long causal pass are linear in length: no
  [L, S] array anywhere in the gradient's jaxpr (the reference has several)."""
  b, l, h, d = 1, 4096, 1, 8
  q = jax.ShapeDtypeStruct((b, l, h, d), jnp.float32)

  def sizes(jaxpr):
    for eqn in jaxpr.eqns:
      yield from (int(np.prod(var.aval.shape)) for var in eqn.outvars if hasattr(var.aval, "shape"))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):  # loop bodies, the custom VJP's rules
        yield from sizes(sub)

  def largest(fn):
    return max(sizes(jax.make_jaxpr(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))(q, q, q).jaxpr))

  assert largest(lambda q, k, v: chunked_attention(q, k, v, causal=True, block_q=256, block_k=256)) < 4 * l * 64
  assert largest(lambda q, k, v: kernels.attention_reference(q, k, v, causal=True)) >= l * l


def test_dispatch_runs_it_from_chunked_from_queries():
  """"xla" (and "pallas" off GPU/TPU) is the reference below CHUNKED_FROM
  queries and the chunked attention from there; a dense mask and
  "reference" stay on the reference."""
  rng = np.random.default_rng(fresh_seed())
  n = kernels.CHUNKED_FROM
  q, k, v, _ = rand_inputs(rng, 1, n, n, 2, 1, 8, jnp.float32)
  chunked = np.asarray(jax.jit(lambda q, k, v: chunked_attention(q, k, v, causal=True))(q, k, v))
  reference = np.asarray(jax.jit(lambda q, k, v: kernels.attention_reference(q, k, v, causal=True))(q, k, v))
  assert not np.array_equal(chunked, reference)  # the two sum in different orders
  for impl in ("xla", "pallas"):
    got = jax.jit(lambda q, k, v: kernels.attention(q, k, v, causal=True, implementation=impl))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), chunked)
  forced = jax.jit(lambda q, k, v: kernels.attention(q, k, v, causal=True, implementation="reference"))(q, k, v)
  np.testing.assert_array_equal(np.asarray(forced), reference)  # "reference": materialised at every length
  short = jax.jit(lambda q, k, v: kernels.attention(q[:, -8:], k, v, causal=True))(q, k, v)
  np.testing.assert_array_equal(
      np.asarray(short), np.asarray(jax.jit(lambda q, k, v: kernels.attention_reference(q[:, -8:], k, v, causal=True))(
          q, k, v)))
  dense = jnp.asarray(rng.random((1, 1, n, n)) < 0.5).at[..., 0].set(True)
  got = jax.jit(lambda q, k, v: kernels.attention(q, k, v, mask=dense))(q, k, v)
  np.testing.assert_array_equal(
      np.asarray(got), np.asarray(jax.jit(lambda q, k, v: kernels.attention_reference(q, k, v, mask=dense))(q, k, v)))


def test_a_long_kv_cache_is_read_up_to_its_filled_prefix():
  """Decoding against a cache of CHUNKED_CACHE_FROM slots runs the chunked
  attention, which stops at the last filled tile; same values as the reference."""
  rng = np.random.default_rng(fresh_seed())
  s, l = kernels.CHUNKED_CACHE_FROM, 16
  q, k, v, _ = rand_inputs(rng, 2, l, s, 2, 1, 8, jnp.float32)
  q_end = jnp.asarray(rng.integers(1, 700, size=(2, 1)) + np.arange(l)[None], jnp.int32)  # a block after a prefix
  mask = AttentionMask(kind="prefix", q_end=q_end, kv_valid=jnp.asarray(rng.random((2, s)) < 0.9).at[:, 0].set(True))
  loops = lambda *a, mask: "while" in str(jax.make_jaxpr(lambda q, k, v: kernels.attention(q, k, v, mask=mask))(*a))  # noqa: E731
  assert loops(q, k, v, mask=mask)  # the chunked attention's key-tile loop
  got = jax.jit(lambda q, k, v: kernels.attention(q, k, v, mask=mask))(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(kernels.attention_reference(q, k, v, mask=mask)),
                             rtol=2e-5, atol=2e-5)
  short = AttentionMask(kind="prefix", q_end=q_end, kv_valid=mask.kv_valid[:, :s // 2])
  assert not loops(q, k[:, :s // 2], v[:, :s // 2], mask=short)  # a shorter cache stays on the reference


@pytest.mark.parametrize("s,block_k", [(45, 8), (40, 8), (5, 8)])
def test_a_cache_read_in_place_equals_a_float64_softmax(s, block_k):
  """Keys [b, g, d, s] and values [b, g, s, d] as a KV cache stores them, s a
  multiple of the tile or not (the last tile moves back over read columns),
  or shorter than one tile; per-row prefixes and invalid slots."""
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  b, l, h, g, d = 2, 7, 4, 2, 8
  q, k, v, _ = rand_inputs(rng, b, l, s, h, g, d, jnp.float32)
  q_end = np.minimum(rng.integers(1, s + 1, size=(b, 1)) + np.arange(l)[None], s)
  valid = (rng.random((b, s)) < 0.8)
  valid[:, 0] = True
  mask = AttentionMask(kind="prefix", q_end=jnp.asarray(q_end, jnp.int32), kv_valid=jnp.asarray(valid))
  allowed = (np.arange(s)[None, None] < q_end[:, :, None]) & valid[:, None]  # [b, l, s]
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  k64, v64 = np.repeat(k64, h // g, axis=2), np.repeat(v64, h // g, axis=2)
  scores = np.where(allowed[:, None], np.einsum("blhd,bshd->bhls", q64, k64) / np.sqrt(d), -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  want = np.einsum("bhls,bshd->blhd", p / p.sum(-1, keepdims=True), v64)
  k_cache, v_cache = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
  got = jax.jit(lambda q, kc, vc: kernels.chunked_cache_attention(q, kc, vc, mask, block_q=4, block_k=block_k))(
      q, k_cache, v_cache)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")


def test_a_long_cache_is_read_where_it_lies():
  """`cache_attention` over one layer of a long cache of every layer's keys
  and values equals `attention` over [b, s, g, d] views of that layer, and
  its program makes nothing the size of a layer (a sliced, transposed or
  padded copy would be one)."""
  rng = np.random.default_rng(fresh_seed())
  s, l, b, g, d = kernels.CHUNKED_CACHE_FROM + 40, 8, 2, 2, 16
  q, k, v, _ = rand_inputs(rng, b, l, s, 4, g, d, jnp.float32)
  q_end = jnp.asarray(rng.integers(1, 900, size=(b, 1)) + np.arange(l)[None], jnp.int32)
  mask = AttentionMask(kind="prefix", q_end=q_end, kv_valid=jnp.ones((b, s), bool))
  other = jnp.asarray(rng.standard_normal((b, g, d, s)), jnp.float32)  # layer 0: not read
  k_cache = jnp.stack([other, k.transpose(0, 2, 3, 1)])
  v_cache = jnp.stack([other.transpose(0, 1, 3, 2), v.transpose(0, 2, 1, 3)])
  fn = jax.jit(lambda q, kc, vc: kernels.cache_attention(q, kc, vc, layer=1, mask=mask))
  np.testing.assert_allclose(np.asarray(fn(q, k_cache, v_cache)),
                             np.asarray(kernels.attention_reference(q, k, v, mask=mask)), rtol=2e-5, atol=2e-5)

  def copies(f):
    """Instructions of f's compiled program that make an array the size of a layer."""
    hlo = f.lower(q, k_cache, v_cache).compile().as_text()
    out = []
    for m in re.finditer(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* ([\w-]+)\(", hlo, re.M):
      size = int(np.prod([int(x) for x in m.group(1).split(",") if x]))
      if size >= b * g * d * s and m.group(2) not in ("parameter", "get-tuple-element", "tuple", "while", "bitcast"):
        out.append(m.group(0).strip())
    return out

  assert not copies(fn)
  views = jax.jit(lambda q, kc, vc: kernels.attention(q, kc[1].transpose(0, 3, 1, 2), vc[1].transpose(0, 2, 1, 3),
                                                      mask=mask))
  assert copies(views)  # what reading [b, s, g, d] views of the layer costs


def test_read_spans_are_powers_of_two_then_the_buffer():
  m = kernels.CACHE_SPAN_MIN
  assert kernels.read_spans(m) == (m,)
  assert kernels.read_spans(m + 1) == (m, m + 1)
  assert kernels.read_spans(5 * m) == (m, 2 * m, 4 * m, 5 * m)


@pytest.mark.parametrize("reach", ["first span", "middle span", "whole buffer"])
def test_a_short_cache_is_read_up_to_the_span_its_queries_reach(reach):
  """A buffer shorter than CHUNKED_CACHE_FROM is cut to the first span that
  holds every query's end: the result equals a float64 softmax over the
  whole buffer, with keys and values past the furthest end large and random
  (read by mistake, they would change it), whichever span the rows reach."""
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  m = kernels.CACHE_SPAN_MIN
  s, l, b, h, g, d = 4 * m + 24, 5, 3, 4, 2, 8
  furthest = {"first span": m, "middle span": 2 * m + 7, "whole buffer": s}[reach]
  q, k, v, _ = rand_inputs(rng, b, l, s, h, g, d, jnp.float32)
  ends = rng.integers(1, furthest - l + 2, size=(b, 1))
  ends[rng.integers(b)] = furthest - l + 1  # one row reaches `furthest` exactly
  q_end = ends + np.arange(l)[None]
  valid = rng.random((b, s)) < 0.8
  valid[:, 0] = True
  k, v = np.array(k), np.array(v)
  k[:, furthest:] *= 1e3
  v[:, furthest:] = rng.standard_normal(v[:, furthest:].shape) * 1e3
  mask = AttentionMask(kind="prefix", q_end=jnp.asarray(q_end, jnp.int32), kv_valid=jnp.asarray(valid))
  allowed = (np.arange(s)[None, None] < q_end[:, :, None]) & valid[:, None]
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  k64, v64 = np.repeat(k64, h // g, axis=2), np.repeat(v64, h // g, axis=2)
  scores = np.where(allowed[:, None], np.einsum("blhd,bshd->bhls", q64, k64) / np.sqrt(d), -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  want = np.einsum("bhls,bshd->blhd", p / p.sum(-1, keepdims=True), v64)
  other = rng.standard_normal((b, g, d, s)).astype(np.float32)  # layer 0: not read
  k_cache = jnp.asarray(np.stack([other, k.transpose(0, 2, 3, 1)]))
  v_cache = jnp.asarray(np.stack([other.transpose(0, 1, 3, 2), v.transpose(0, 2, 1, 3)]))
  got = jax.jit(lambda q, kc, vc, mask: kernels.cache_attention(q, kc, vc, layer=1, mask=mask))(
      q, k_cache, v_cache, mask)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
