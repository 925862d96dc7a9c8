"""Gumbel-max sampling: the right distribution, and float64 noise on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.sampling import gumbel
from mdlm_jax.sampling.gumbel import argmax, gumbel_argmax, random_words


def _reference_argmax(logits, words, temperature):
  """The same draw in float64 numpy, straight from the formula."""
  hi, lo = (np.asarray(w, np.uint64) for w in words)
  u = (((hi >> 6) << 26) + (lo >> 6)).astype(np.float64) * 2.0**-52 + 2.0**-53
  return np.argmax(np.asarray(logits, np.float64) / temperature - np.log(-np.log(u)), axis=-1)


@pytest.mark.parametrize("width", [1000, 4 * gumbel.SEARCH_BLOCK])  # searched whole, and by blocks
@pytest.mark.parametrize("nan_first", [False, True])
@pytest.mark.parametrize("way", [argmax, gumbel._max_then_search, gumbel._pairwise_argmax])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_argmax_is_numpys_first_index(dtype, way, nan_first, width):
  """Ties (values drawn from a few levels) go to the first index, as do
  -inf rows and NaN (numpy's argmax takes the first NaN, here after maxima),
  both ways `argmax` may take and whichever it takes (a row that starts with
  NaN sends it the second way). By blocks: a NaN in a later block than the
  maximum's, and a maximum tied across blocks."""
  rng = np.random.default_rng()
  half = width // 2
  x = rng.integers(-3, 4, size=(3, 5, width)).astype(dtype)
  x[0, 1] = -np.inf
  x[1, 2, half + rng.integers(half, size=3)] = np.nan
  x[1, 2, rng.integers(half)] = 9
  x[2, 1, [width - 1, half + 1]] = 9
  if nan_first:
    x[2, 3, 0] = np.nan
  with jax.enable_x64(dtype == np.float64):
    got = np.asarray(jax.jit(way)(jnp.asarray(x)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


def test_float64_reaches_the_tail_float32_cannot():
  """All-ones bits put u within 2^-53 of 1: a Gumbel of 36.7 in float64, but
  float32's u stops at 1 - 2^-24 (Gumbel 16.6), so a logit gap of 20 flips."""
  logits = jnp.array([[0.0, 20.0]])
  words = jnp.array([[[0xFFFFFFFF, 1 << 31]], [[0xFFFFFFFF, 0]]], jnp.uint32)  # u ~ [1 - 2^-53, 0.5]
  assert int(gumbel_argmax(logits, words, float64=True)[0]) == 0
  assert int(gumbel_argmax(logits, words, float64=False)[0]) == 1
  assert _reference_argmax(logits, words, 1.0)[0] == 0
  assert -np.log(-np.log1p(-2.0**-53)) == pytest.approx(36.74, abs=0.01)


def test_float64_matches_numpy_reference():
  rng = np.random.default_rng()
  logits = jnp.asarray(rng.normal(size=(64, 300)) * 2, jnp.float32)
  words = random_words(jax.random.key(int(rng.integers(1 << 30))), logits.shape)
  for temperature in (1.0, 0.7):
    got = np.asarray(gumbel_argmax(logits, words, temperature, float64=True))
    np.testing.assert_array_equal(got, _reference_argmax(logits, words, temperature))


@pytest.mark.parametrize("float64", [True, False])
def test_frequencies_follow_softmax(float64):
  rng = np.random.default_rng()
  p = rng.dirichlet(np.ones(6))
  temperature = 0.8
  n = 40_000
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, 6))
  words = random_words(jax.random.key(int(rng.integers(1 << 30))), logits.shape)
  draws = np.asarray(gumbel_argmax(logits, words, temperature, float64=float64))
  q = p ** (1 / temperature) / np.sum(p ** (1 / temperature))
  freq = np.bincount(draws, minlength=6) / n
  np.testing.assert_array_less(np.abs(freq - q), 5 * np.sqrt(q * (1 - q) / n) + 1e-9)


def test_cpu_default_runs_in_float64_inside_jit():
  logits = jnp.zeros((2, 8))
  words = random_words(jax.random.key(0), logits.shape)
  hlo = jax.jit(lambda l, w: gumbel_argmax(l, w, 1.0)).lower(logits, words).as_text()
  assert "f64" in hlo
  assert jax.jit(lambda l, w: gumbel_argmax(l, w, 1.0)).lower(logits, words).out_info.dtype == jnp.int32


def test_top_p_filter_keeps_the_nucleus():
  """Against a float64 numpy nucleus: the fewest most-likely tokens whose mass reaches top_p."""
  from mdlm_jax.sampling.gumbel import top_p_filter
  rng = np.random.default_rng()
  logits = rng.normal(size=(5, 40)) * 2
  top_p = rng.uniform(0.05, 0.95, size=(5, 1))
  got = np.isfinite(np.asarray(top_p_filter(jnp.asarray(logits, jnp.float32), jnp.asarray(top_p, jnp.float32))))
  for r in range(5):
    p = np.exp(logits[r] - logits[r].max())
    p /= p.sum()
    order = np.argsort(-p)
    n = int(np.searchsorted(np.cumsum(p[order]), top_p[r, 0]) + 1)
    want = np.zeros(40, bool)
    want[order[:n]] = True
    np.testing.assert_array_equal(got[r], want)


def test_a_top_p_of_one_keeps_the_whole_tail():
  """A row at top_p 1 keeps every token, however small, beside a row whose
  nucleus is cut: a float32 running sum reaches 1 before the tail ends."""
  from mdlm_jax.sampling.gumbel import top_p_filter
  rng = np.random.default_rng()
  logits = np.concatenate([rng.normal(size=(2, 8)) * 2 + 20, rng.normal(size=(2, 4000)) * 3 - 10], axis=1)
  got = np.asarray(top_p_filter(jnp.asarray(logits, jnp.float32), jnp.asarray([[1.0], [0.5]], jnp.float32)))
  assert np.isfinite(got[0]).all()
  p = np.exp(logits[1] - logits[1].max())
  p /= p.sum()
  order = np.argsort(-p)
  n = int(np.searchsorted(np.cumsum(p[order]), 0.5) + 1)
  assert np.isfinite(got[1]).sum() == n
