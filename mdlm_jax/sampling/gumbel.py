"""Gumbel-max categorical sampling, in float64 on CPU and float32 elsewhere.

In float32 the uniform u behind a Gumbel draw -log(-log u) cannot come closer
to 1 than 2^-24, so no Gumbel exceeds about 16.6 and the top of its tail is
coarsely quantised: sampling runs colder than the temperature asked for, and
masked diffusion, which draws one categorical per position per step, suffers
most (Zheng et al. 2024). On CPU, where float64 is cheap, the noise and the
argmax run in float64 from 52 random bits (Gumbels up to 36.7); elsewhere in
float32 from the top 23 of the same bits, so both paths draw the same uniforms
up to precision.

Float64 inside an otherwise float32 program: the block below is traced with
x64 enabled and uses lax ops only (jnp helpers cache float32 reductions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mdlm_jax.kernels.numerics import gumbel_float32


def use_float64() -> bool:
  return jax.default_backend() == "cpu"


def argmax(x: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis, int32: the first index of the maximum
  (of the first NaN, as jnp.argmax). lax ops only (jnp's argmax fixes a
  float32 initial value), so it also serves the float64 block below.

  Two ways to the same index, behind a conditional: its operand is a buffer
  both ways read, where XLA would fuse the ops that compute `x` into each
  reduction. A max followed by a search for the first index that reaches it
  (a vocabulary's row: 0.8 ms less a six-column pass on XLA:CPU than the
  second way) needs that: fused into both, each compiles `x` with its own
  rounding (a multiply-add contracted in one and not in the other), no
  element need equal "the" maximum, and under a frequency penalty the search
  returned the index past the end. The second way, one (value, index)
  reduction, takes rows whose first element is NaN (any predicate unknown to
  the compiler would do). Elsewhere the reduction alone: a GPU reads a
  conditional's predicate on the host, a sync every step."""
  if jax.default_backend() != "cpu":
    return _pairwise_argmax(x)
  first = lax.index_in_dim(x, 0, axis=x.ndim - 1, keepdims=False)
  return lax.cond(jnp.all(first == first), _max_then_search, _pairwise_argmax, x)


SEARCH_BLOCK = 128  # columns a block of the blockwise search (`_max_then_search`)


def _max_then_search(x: jax.Array) -> jax.Array:
  """The maximum, then the first index that reaches it. Over a vocabulary's
  row the search goes by blocks: XLA:CPU's max of each block of SEARCH_BLOCK
  columns (a fast reduction) picks the first block that holds a NaN or the
  maximum, and only that block is searched by index (a search of the whole
  row is a slow reduction: 0.42 against 0.34 ms for seven rows of 49,152
  columns, measured)."""
  axis, n = x.ndim - 1, x.shape[-1]
  if n % SEARCH_BLOCK or n < 2 * SEARCH_BLOCK:
    top = lax.expand_dims(lax.reduce_max(x, (axis,)), (axis,))  # XLA:CPU's max may pass over NaN
    return _first_at(x, top, axis)
  nb = n // SEARCH_BLOCK
  blocks = lax.reshape(x, (*x.shape[:-1], nb, SEARCH_BLOCK))
  block_max = lax.reduce_max(blocks, (axis + 1,))
  nan = lax.reduce_max(lax.select(blocks != blocks, lax.full(blocks.shape, 1, x.dtype),
                                  lax.full(blocks.shape, 0, x.dtype)), (axis + 1,)) > 0
  top = lax.expand_dims(lax.reduce_max(block_max, (axis,)), (axis,))
  # The first block with a NaN (numpy's argmax takes the first NaN), else the first with the maximum.
  iota = lax.broadcasted_iota(jnp.int32, block_max.shape, axis)
  key = lax.select(nan, iota - nb, lax.select(block_max == top, iota, lax.full(block_max.shape, nb, jnp.int32)))
  block = lax.reduce_min(key, (axis,))
  block = jnp.minimum(jnp.where(block < 0, block + nb, block), nb - 1)
  row = jnp.take_along_axis(blocks, block[..., None, None], axis=axis)[..., 0, :]
  return block * SEARCH_BLOCK + _first_at(row, top, axis)


def _first_at(x: jax.Array, top: jax.Array, axis: int) -> jax.Array:
  """The first index of a NaN along `axis`, else of `top`."""
  n = x.shape[axis]
  iota = lax.broadcasted_iota(jnp.int32, x.shape, axis)
  # One search: a NaN's index less n, before any maximum's; else n.
  key = lax.select(x != x, iota - n, lax.select(x == top, iota, lax.full(x.shape, n, jnp.int32)))
  first = lax.reduce_min(key, (axis,))
  return jnp.where(first < 0, first + n, first)


def _pairwise_argmax(x: jax.Array) -> jax.Array:
  axis = x.ndim - 1
  iota = lax.broadcasted_iota(jnp.int32, x.shape, axis)

  def first_of_the_larger(a, b):
    (av, ai), (bv, bi) = a, b
    a_nan, b_nan = av != av, bv != bv
    take_a = (av > bv) | (a_nan & ~b_nan) | (((av == bv) | (a_nan & b_nan)) & (ai < bi))
    return lax.select(take_a, av, bv), lax.select(take_a, ai, bi)

  init = (lax.full((), -np.inf, x.dtype), lax.full((), x.shape[axis], jnp.int32))
  return lax.reduce((x, iota), init, first_of_the_larger, (axis,))[1]


def random_words(key, shape) -> jax.Array:
  """Two uint32 words per draw, [2, *shape]."""
  return jax.random.bits(key, (2, *shape), jnp.uint32)


def gumbel_argmax(logits: jax.Array, words: jax.Array, temperature: float = 1.0,
                  float64: bool | None = None) -> jax.Array:
  """argmax(logits / temperature + Gumbel) over the last axis, int32; `words`
  [2, *logits.shape] from `random_words`. Ties go to the lower index."""
  if float64 is None:
    float64 = use_float64()
  hi, lo = words[0], words[1]
  if not float64:
    g = gumbel_float32(hi)
    return argmax(logits.astype(jnp.float32) / temperature + g)
  with jax.enable_x64(True):
    f64 = jnp.float64
    top = lax.convert_element_type(hi >> 6, f64)  # 26 bits
    low = lax.convert_element_type(lo >> 6, f64)  # 26 bits
    u = (top * np.float64(2.0**26) + low + np.float64(0.5)) * np.float64(2.0**-52)  # in [2^-53, 1 - 2^-53]
    return argmax(lax.convert_element_type(logits, f64) / np.float64(temperature) - lax.log(-lax.log(u)))


def top_p_filter(logits: jax.Array, top_p) -> jax.Array:
  """Logits outside the nucleus (the most likely tokens whose mass reaches
  top_p) set to -inf, over the last axis. `top_p` broadcasts against
  logits[..., :1]; the most likely token always stays, so a tiny top_p is
  greedy, and a top_p of 1 keeps every token (a float32 running sum reaches 1
  before the tail ends: a row at 1 beside a row below it lost its tail)."""
  desc = -jnp.sort(-logits, axis=-1)
  probs = jax.nn.softmax(desc, axis=-1)
  top_p = jnp.asarray(top_p, probs.dtype)
  inside = ((jnp.cumsum(probs, axis=-1) - probs) < top_p) | (top_p >= 1)  # the mass strictly before a token
  cutoff = jnp.min(jnp.where(inside, desc, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits >= cutoff, logits, -jnp.inf)
