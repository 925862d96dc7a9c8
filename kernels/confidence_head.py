"""Fused confidence head: the vocabulary projection, softmax statistics and
Gumbel-max sampling in one pass over vocabulary tiles.

A diffusion sampler needs, per position, a sampled token, its probability
and the top probability: three numbers out of a [B, L, V] logits tensor.
The kernel keeps, per row, a running max and sum (the log-sum-exp) and the
best perturbed score with its index and logit, so the logits are never
written to memory.

The Gumbel noise comes from random bits given as input (the first word of
`sampling.gumbel.random_words`, float32 path), so a fused step samples
exactly what the materialised-logits path samples from the same bits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, UInt32

from mdlm_jax.kernels.numerics import NEG_INF, gumbel_float32


@dataclasses.dataclass(frozen=True)
class HeadBlockSizes:
  """Tile sizes. On GPU a product reads the hidden size in slices of
  `block_hidden` (0: whole): with whole rows, a [64, 1024] by [1024, 256]
  bfloat16 product asked an H200 for 1.2 MB of shared memory (it has 227 KB)."""

  block_rows: int = 64
  block_vocab: int = 128
  block_hidden: int = 64

  @classmethod
  def get_default(cls, backend: str = "gpu") -> "HeadBlockSizes":
    return cls(256, 1024, 0) if backend == "tpu" else cls()


@dataclasses.dataclass(frozen=True)
class HeadSettings:
  """Static settings of one head call."""

  temperature: float = 1.0  # 0: argmax
  # Tokens never proposed: the [MASK] id under SUBS, and the markers a model
  # reads but never writes (`tokenizer.never_generated`).
  exclude_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if not all(isinstance(i, int) and i >= 0 for i in self.exclude_ids):
      raise ValueError(f"exclude_ids must be a tuple of token ids >= 0, got {self.exclude_ids!r}")


def _logits(hidden2d, w):
  return jnp.matmul(hidden2d, w.astype(hidden2d.dtype), preferred_element_type=jnp.float32)


def confidence_head_reference(
    hidden: Float[Array, "b t d"],
    w: Float[Array, "d v"],
    bits: UInt32[Array, "b t v"] | None,
    settings: HeadSettings = HeadSettings(),
) -> tuple[Int[Array, "b t"], Float[Array, "b t"], Float[Array, "b t"]]:
  """(token, p(token), max p) per position from materialised logits: log-softmax
  and Gumbel-max (argmax when `settings.temperature` is 0 or `bits` is None)."""
  b, t, d = hidden.shape
  logits = _logits(hidden.reshape(b * t, d), w).reshape(b, t, -1)
  if settings.exclude_ids:
    logits = logits.at[..., list(settings.exclude_ids)].set(NEG_INF)
  logp = jax.nn.log_softmax(logits, axis=-1)
  y = logits if bits is None or settings.temperature == 0 else logits / settings.temperature + gumbel_float32(bits)
  token = jnp.argmax(y, axis=-1).astype(jnp.int32)
  prob = jnp.exp(jnp.take_along_axis(logp, token[..., None], axis=-1)[..., 0])
  return token, prob, jnp.exp(jnp.max(logp, axis=-1))


def _tile_update(state, logits, y, col, start):
  """Folds one vocabulary tile (its first column `start`) into (max, sum, best
  score, best index, best logit). `start` comes as a scalar: slicing `col`
  has no Pallas Triton lowering."""
  m, s, best, idx, best_logit = state
  m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
  s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new), axis=1, keepdims=True)
  tile_best = jnp.max(y, axis=1, keepdims=True)
  # The first maximum's column by argmax, not by comparing y with its max: a
  # compiler may compute y once for each reduction and round them apart.
  tile_idx = start + jnp.argmax(y, axis=1, keepdims=True).astype(jnp.int32)
  tile_logit = jnp.sum(jnp.where(col == tile_idx, logits, 0.0), axis=1, keepdims=True)
  better = tile_best > best  # strict: ties keep the lower index, as argmax does
  return (m_new, s, jnp.where(better, tile_best, best), jnp.where(better, tile_idx, idx),
          jnp.where(better, tile_logit, best_logit))


def _tile_scores(logits, bits_tile, col, v: int, st: HeadSettings):
  for i in st.exclude_ids:  # a handful of ids: unrolled compares
    logits = jnp.where(col == i, NEG_INF, logits)
  logits = jnp.where(col < v, logits, -jnp.inf)
  y = logits if bits_tile is None else logits / st.temperature + gumbel_float32(bits_tile)
  return logits, jnp.where(col < v, y, -jnp.inf)


def _dot(a, b):
  return lax.dot_general(a, b.astype(a.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _init(bn):
  ninf = jnp.full((bn, 1), -jnp.inf, jnp.float32)
  return ninf, jnp.zeros((bn, 1), jnp.float32), ninf, jnp.zeros((bn, 1), jnp.int32), jnp.zeros((bn, 1), jnp.float32)


def _write(state, tok_ref, prob_ref, maxp_ref):
  m, s, _, idx, best_logit = state
  lse = m + jnp.log(s)
  tok_ref[...] = idx
  prob_ref[...] = jnp.exp(best_logit - lse)
  maxp_ref[...] = jnp.exp(m - lse)


def _head_loop_kernel(h_ref, w_ref, *rest, v: int, bv: int, bk: int, st: HeadSettings, sample: bool):
  """GPU: one program per row tile, looping over the vocabulary tiles."""
  bits_ref, (tok_ref, prob_ref, maxp_ref) = (rest[0], rest[1:]) if sample else (None, rest)
  bn, d = h_ref.shape
  bk = bk or d

  def body(j, state):
    cols = pl.ds(j * bv, bv)
    col = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)

    def slice_of_hidden(k, acc):
      ks = pl.ds(k * bk, bk)
      return acc + _dot(h_ref[:, ks], w_ref[ks, cols])
    logits = lax.fori_loop(0, d // bk, slice_of_hidden, jnp.zeros((bn, bv), jnp.float32))
    logits, y = _tile_scores(logits, None if bits_ref is None else bits_ref[:, cols], col, v, st)
    return _tile_update(state, logits, y, col, j * bv)

  _write(lax.fori_loop(0, w_ref.shape[1] // bv, body, _init(bn)), tok_ref, prob_ref, maxp_ref)


def _head_grid_kernel(h_ref, w_ref, *rest, v: int, bv: int, bk: int, st: HeadSettings, sample: bool):
  """TPU: the vocabulary tile is the inner grid axis; the row state lives in scratch."""
  bits_ref, rest = (rest[0], rest[1:]) if sample else (None, rest)
  tok_ref, prob_ref, maxp_ref, *scratch = rest
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    for ref, x in zip(scratch, _init(h_ref.shape[0])):
      ref[...] = x

  col = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
  del bk  # a TPU tile's product reads whole rows
  logits, y = _tile_scores(_dot(h_ref[...], w_ref[...]), None if bits_ref is None else bits_ref[...], col, v, st)
  for ref, x in zip(scratch, _tile_update(tuple(r[...] for r in scratch), logits, y, col, j * bv)):
    ref[...] = x

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    _write(tuple(r[...] for r in scratch), tok_ref, prob_ref, maxp_ref)


def _triton_params():
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _pad(x, axis, n):
  if x.shape[axis] == n:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, pad)


def confidence_head_pallas(
    hidden: Float[Array, "b t d"],
    w: Float[Array, "d v"],
    bits: UInt32[Array, "b t v"] | None,
    settings: HeadSettings = HeadSettings(),
    *,
    block_sizes: HeadBlockSizes | None = None,
    backend: str = "gpu",
    interpret: bool = False,
) -> tuple[Int[Array, "b t"], Float[Array, "b t"], Float[Array, "b t"]]:
  """The Pallas kernel of `confidence_head_reference` (same arguments and results)."""
  if backend not in ("gpu", "tpu"):
    raise ValueError(f"unknown confidence head backend {backend!r}; choose from ('gpu', 'tpu')")
  b, t, d = hidden.shape
  v = w.shape[1]
  blocks = block_sizes or HeadBlockSizes.get_default(backend)
  n = b * t
  bn = min(blocks.block_rows, max(16, pl.next_power_of_2(n)))
  bv = min(blocks.block_vocab, max(16, pl.next_power_of_2(v)))
  bk = min(blocks.block_hidden, max(16, pl.next_power_of_2(d))) if backend == "gpu" else 0
  np_, vp, dp = -(-n // bn) * bn, -(-v // bv) * bv, -(-d // bk) * bk if bk else d
  sample = bits is not None and settings.temperature > 0
  h2 = _pad(_pad(hidden.reshape(n, d), 0, np_), 1, dp)  # zero columns and rows add nothing
  w2 = _pad(_pad(w.astype(hidden.dtype), 1, vp), 0, dp)
  args = [h2, w2] + ([_pad(_pad(bits.reshape(n, v), 0, np_), 1, vp)] if sample else [])
  out_shape = [jax.ShapeDtypeStruct((np_, 1), jnp.int32)] + [jax.ShapeDtypeStruct((np_, 1), jnp.float32)] * 2
  kw = dict(v=v, bv=bv, bk=bk, st=settings, sample=sample)
  if backend == "gpu":
    in_specs = [pl.BlockSpec((bn, dp), lambda i: (i, 0)), pl.BlockSpec((dp, vp), lambda i: (0, 0))]
    in_specs += [pl.BlockSpec((bn, vp), lambda i: (i, 0))] if sample else []
    call = pl.pallas_call(functools.partial(_head_loop_kernel, **kw), grid=(np_ // bn,), in_specs=in_specs,
                          out_specs=[pl.BlockSpec((bn, 1), lambda i: (i, 0))] * 3, out_shape=out_shape,
                          interpret=interpret, compiler_params=None if interpret else _triton_params())
  else:
    from jax.experimental.pallas import tpu as pltpu
    in_specs = [pl.BlockSpec((bn, d), lambda i, j: (i, 0)), pl.BlockSpec((d, bv), lambda i, j: (0, j))]
    in_specs += [pl.BlockSpec((bn, bv), lambda i, j: (i, j))] if sample else []
    scratch = [pltpu.VMEM((bn, 1), dt) for dt in (jnp.float32, jnp.float32, jnp.float32, jnp.int32, jnp.float32)]
    call = pl.pallas_call(
        functools.partial(_head_grid_kernel, **kw), grid=(np_ // bn, vp // bv), in_specs=in_specs,
        out_specs=[pl.BlockSpec((bn, 1), lambda i, j: (i, 0))] * 3, out_shape=out_shape, scratch_shapes=scratch,
        interpret=interpret,
        compiler_params=None if interpret else pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))
  tok, prob, maxp = call(*args)
  return tuple(x[:n, 0].reshape(b, t) for x in (tok, prob, maxp))
