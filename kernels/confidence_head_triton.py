"""The fused confidence head written in Triton and called through jax-triton
(the `gpu` extra). Same arguments and results as `confidence_head_reference`.

`triton` and `jax_triton` are imported only when this runs, which the
dispatcher allows only on a CUDA backend, so the package imports cleanly
without them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mdlm_jax.kernels.numerics import NEG_INF
from mdlm_jax.kernels.confidence_head import HeadBlockSizes, HeadSettings


@functools.cache
def _kernel():
  import triton
  import triton.language as tl

  @triton.jit
  def head_kernel(h_ptr, w_ptr, bits_ptr, exclude_ptr, tok_ptr, prob_ptr, maxp_ptr,
                  N: tl.constexpr, V: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                  BK: tl.constexpr, TEMPERATURE: tl.constexpr, NUM_EXCLUDED: tl.constexpr, SAMPLE: tl.constexpr,
                  NEG: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.full([BN], float("-inf"), tl.float32)
    s = tl.zeros([BN], tl.float32)
    best = tl.full([BN], float("-inf"), tl.float32)
    idx = tl.zeros([BN], tl.int32)
    best_logit = tl.zeros([BN], tl.float32)
    for j in range(0, tl.cdiv(V, BV)):
      cols = j * BV + tl.arange(0, BV)
      inside = cols[None, :] < V
      # The hidden size in slices of BK: the dot's operands fit shared memory at any D.
      logits = tl.zeros([BN, BV], tl.float32)
      for k in range(0, tl.cdiv(D, BK)):
        dd = k * BK + tl.arange(0, BK)
        h = tl.load(h_ptr + rows[:, None] * D + dd[None, :], mask=(rows[:, None] < N) & (dd[None, :] < D), other=0.0)
        w = tl.load(w_ptr + dd[:, None] * V + cols[None, :], mask=(dd[:, None] < D) & inside, other=0.0)
        logits += tl.dot(h, w.to(h.dtype))
      for e in tl.static_range(NUM_EXCLUDED):
        logits = tl.where(cols[None, :] == tl.load(exclude_ptr + e), NEG, logits)
      logits = tl.where(inside, logits, float("-inf"))
      if SAMPLE:
        hi = tl.load(bits_ptr + rows[:, None] * V + cols[None, :], mask=(rows[:, None] < N) & inside, other=0)
        u = ((hi >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23, as sampling.gumbel
        y = logits / TEMPERATURE - tl.log(-tl.log(u))
        y = tl.where(inside, y, float("-inf"))
      else:
        y = logits
      m_new = tl.maximum(m, tl.max(logits, axis=1))
      s = s * tl.exp(m - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
      m = m_new
      tile_best = tl.max(y, axis=1)
      tile_idx = tl.min(tl.where(y == tile_best[:, None], cols[None, :], 2147483647), axis=1)
      tile_logit = tl.sum(tl.where(cols[None, :] == tile_idx[:, None], logits, 0.0), axis=1)
      better = tile_best > best
      best = tl.where(better, tile_best, best)
      idx = tl.where(better, tile_idx, idx)
      best_logit = tl.where(better, tile_logit, best_logit)
    lse = m + tl.log(s)
    keep = rows < N
    tl.store(tok_ptr + rows, idx, mask=keep)
    tl.store(prob_ptr + rows, tl.exp(best_logit - lse), mask=keep)
    tl.store(maxp_ptr + rows, tl.exp(m - lse), mask=keep)

  return head_kernel


def launch(hidden, w, bits, settings: HeadSettings = HeadSettings(), *, block_sizes: HeadBlockSizes | None = None):
  """(inputs, output shapes, grid, compile-time constants) of one launch of
  the kernel: what jax-triton is handed, and what a test hands Triton's
  interpreter."""
  b, t, d = hidden.shape
  v, n = w.shape[1], b * t
  blocks = block_sizes or HeadBlockSizes()
  sample = bits is not None and settings.temperature > 0
  inputs = (hidden.reshape(n, d), w.astype(hidden.dtype), bits.reshape(n, v) if sample else jnp.zeros((1,), jnp.uint32),
            jnp.asarray(settings.exclude_ids or (0,), jnp.int32))  # the last read only when NUM_EXCLUDED > 0
  out_shape = [jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32),
               jax.ShapeDtypeStruct((n,), jnp.float32)]
  # The sizes go in as compile-time constants: jax-triton hands plain int arguments to
  # Triton 3.6 as pointers (seen on an H200), and a kernel is compiled per shape anyway.
  constants = dict(N=n, V=v, D=d, BN=blocks.block_rows, BV=blocks.block_vocab, BK=blocks.block_hidden or max(16, 1 << (d - 1).bit_length()),
                   TEMPERATURE=float(settings.temperature) if sample else 1.0,
                   NUM_EXCLUDED=len(settings.exclude_ids), SAMPLE=sample, NEG=NEG_INF)
  return inputs, out_shape, (-(-n // blocks.block_rows),), constants


def confidence_head_triton(hidden, w, bits, settings: HeadSettings = HeadSettings(), *,
                           block_sizes: HeadBlockSizes | None = None):
  """(token, p(token), max p) per position; see `confidence_head_reference`."""
  import jax_triton as jt
  b, t, _ = hidden.shape
  inputs, out_shape, grid, constants = launch(hidden, w, bits, settings, block_sizes=block_sizes)
  tok, prob, maxp = jt.triton_call(*inputs, kernel=_kernel(), out_shape=out_shape, grid=grid, **constants)
  return tok.reshape(b, t), prob.reshape(b, t), maxp.reshape(b, t)
