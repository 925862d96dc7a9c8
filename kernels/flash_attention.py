"""Flash attention in Pallas: forward and backward (`jax.custom_vjp`), for the
structural masks of `masks.AttentionMask`.

Two variants share the tile math and differ only in how they walk the keys:
- "gpu" (Triton lowering): a grid over (batch, head, query tile); each program
  loops over the key tiles it needs with `fori_loop` (the range comes from the
  mask's structure, so causal and block-diffusion masks skip whole tiles).
- "tpu" (Mosaic): a grid over (batch, head, query tile, key tile) with the
  running max / sum / accumulator in VMEM scratch; tiles outside the mask's
  range are skipped with `pl.when`.
Both run on CPU with `interpret=True`, which is how the tests check them.

Scores, the online softmax and the saved log-sum-exp are float32; the two
matmuls take the input dtype (bf16 on accelerators). A query that may read no
key at all gets output 0 (the reference gives the mean of the values there;
such rows are padding whose output nobody reads).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from mdlm_jax.kernels.masks import AttentionMask, MaskSpec, kv_tile_range, q_tile_range, resolve, tile_mask

BACKENDS = ("gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the forward, the dk/dv pass and the dq pass (static under jit)."""

  block_q: int = 128
  block_k: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64

  @classmethod
  def get_default(cls, backend: str = "gpu") -> "BlockSizes":
    if backend == "tpu":  # MXU-sized tiles; VMEM holds a [512, 512] float32 score tile easily
      return cls(512, 512, 512, 512, 512, 512)
    return cls()


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the kernels specialise on: hashable, a nondiff argument."""

  spec: MaskSpec
  l: int
  s: int
  scale: float
  blocks: BlockSizes
  backend: str
  interpret: bool


def _fit(block: int, n: int) -> int:
  """The tile used for a length-n axis: the configured one, or less for short axes."""
  return min(block, max(16, pl.next_power_of_2(n)))


def _dot(a, b, *, ta: bool = False, tb: bool = False):
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _mask(c: _Static, q_lo, k_lo, bq, bk, q_seg, q_end, kv_seg, kv_valid):
  qi = q_lo + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  kj = k_lo + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  return tile_mask(c.spec, qi, kj, l=c.l, s=c.s, q_seg=q_seg if c.spec.has_segments else None,
                   kv_seg=kv_seg, kv_valid=kv_valid if c.spec.has_valid else None, q_end=q_end, bounds=True)


def _may_be_empty(c: _Static) -> bool:
  """Whether tiles inside the structural range can still be fully masked (then test before computing)."""
  return c.spec.has_segments or c.spec.has_valid or c.spec.kind in ("block_diffusion", "block_diffusion_causal", "prefix")


def _skip_empty(c: _Static, mask, compute, carry):
  if not _may_be_empty(c):
    return compute(carry)
  return lax.cond(jnp.max(mask.astype(jnp.int32)) > 0, compute, lambda x: x, carry)


# --- tile math shared by both variants -------------------------------------

def _online_softmax_step(carry, q, k, v, mask, scale):
  m, lsum, acc = carry
  sc = jnp.where(mask, _dot(q, k, tb=True) * scale, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
  shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  p = jnp.exp(sc - shift)
  alpha = jnp.exp(m - shift)
  return m_new, alpha * lsum + jnp.sum(p, axis=1, keepdims=True), alpha * acc + _dot(p.astype(v.dtype), v)


def _finish(m, lsum, acc):
  empty = lsum == 0.0
  out = acc / jnp.where(empty, 1.0, lsum)
  return out, jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, lsum)))


def _probs_and_dscores(q, k, v, do, lse, delta, mask, scale):
  p = jnp.where(mask, jnp.exp(_dot(q, k, tb=True) * scale - lse), 0.0)
  ds = p * (_dot(do, v, tb=True) - delta)
  return p, ds


def _init_stats(bq, d):
  return (jnp.full((bq, 1), -jnp.inf, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros((bq, d), jnp.float32))


# --- "gpu": one program per query (or key) tile, looping over the other axis

def _key_loop(c: _Static, bk: int, q_ref, k_ref, v_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref):
  """For the program of one query tile: the [first, last) key tiles to visit
  and a function loading key tile j (its keys, values and mask)."""
  bq = q_ref.shape[0]
  q_lo, q_seg, q_end = pl.program_id(2) * bq, qseg_ref[...], qend_ref[...]
  first, last = kv_tile_range(c.spec, q_lo, q_lo + bq, l=c.l, s=c.s, block_k=bk, num_k_blocks=k_ref.shape[0] // bk,
                              q_end_max=jnp.max(q_end))

  def load(j):
    ks = pl.ds(j * bk, bk)
    return k_ref[ks, :], v_ref[ks, :], _mask(c, q_lo, j * bk, bq, bk, q_seg, q_end, kvseg_ref[:, ks],
                                             valid_ref[:, ks])

  return first, last, load


def _fwd_loop_kernel(q_ref, k_ref, v_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref, o_ref, lse_ref, *, c: _Static):
  bq, d = q_ref.shape
  q = q_ref[...]
  first, last, load = _key_loop(c, _fit(c.blocks.block_k, c.s), q_ref, k_ref, v_ref, qseg_ref, qend_ref, kvseg_ref,
                                valid_ref)

  def body(j, carry):
    k, v, mask = load(j)
    return _skip_empty(c, mask, lambda cr: _online_softmax_step(cr, q, k, v, mask, c.scale), carry)

  out, lse = _finish(*lax.fori_loop(first, last, body, _init_stats(bq, d)))
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = lse


def _dq_loop_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref,
                    dq_ref, *, c: _Static):
  bq, d = q_ref.shape
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  first, last, load = _key_loop(c, _fit(c.blocks.block_k_dq, c.s), q_ref, k_ref, v_ref, qseg_ref, qend_ref,
                                kvseg_ref, valid_ref)

  def body(j, dq):
    k, v, mask = load(j)

    def compute(dq):
      _, ds = _probs_and_dscores(q, k, v, do, lse, delta, mask, c.scale)
      return dq + _dot(ds.astype(k.dtype), k)

    return _skip_empty(c, mask, compute, dq)

  dq = lax.fori_loop(first, last, body, jnp.zeros((bq, d), jnp.float32))
  dq_ref[...] = (dq * c.scale).astype(dq_ref.dtype)


def _dkv_loop_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref,
                     dk_ref, dv_ref, *, c: _Static):
  bk, d = k_ref.shape
  bq = _fit(c.blocks.block_q_dkv, c.l)
  k_lo = pl.program_id(2) * bk
  k, v, kv_seg, valid = k_ref[...], v_ref[...], kvseg_ref[...], valid_ref[...]
  first, last = q_tile_range(c.spec, k_lo, k_lo + bk, l=c.l, s=c.s, block_q=bq, num_q_blocks=q_ref.shape[0] // bq)

  def body(i, carry):
    qs = pl.ds(i * bq, bq)
    q, do, lse, delta = q_ref[qs, :], do_ref[qs, :], lse_ref[qs, :], delta_ref[qs, :]
    mask = _mask(c, i * bq, k_lo, bq, bk, qseg_ref[qs, :], qend_ref[qs, :], kv_seg, valid)

    def compute(carry):
      dk, dv = carry
      p, ds = _probs_and_dscores(q, k, v, do, lse, delta, mask, c.scale)
      return dk + _dot(ds.astype(q.dtype), q, ta=True), dv + _dot(p.astype(do.dtype), do, ta=True)

    return _skip_empty(c, mask, compute, carry)

  zeros = jnp.zeros((bk, d), jnp.float32)
  dk, dv = lax.fori_loop(first, last, body, (zeros, zeros))
  dk_ref[...] = (dk * c.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# --- "tpu": the other axis is the innermost grid dimension, state in scratch

def _in_range(c, first, last, idx):
  return (idx >= first) & (idx < last)


def _key_tile(c: _Static, q_ref, k_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref):
  """For the program of (query tile, key tile): the key tile index, whether
  the mask's structure reaches it, and a function building its mask."""
  bq, bk = q_ref.shape[0], k_ref.shape[0]
  q_lo, kb, q_end = pl.program_id(2) * bq, pl.program_id(3), qend_ref[...]
  first, last = kv_tile_range(c.spec, q_lo, q_lo + bq, l=c.l, s=c.s, block_k=bk, num_k_blocks=pl.num_programs(3),
                              q_end_max=jnp.max(q_end))
  mask = lambda: _mask(c, q_lo, kb * bk, bq, bk, qseg_ref[...], q_end, kvseg_ref[...], valid_ref[...])
  return kb, _in_range(c, first, last, kb), mask


def _fwd_grid_kernel(q_ref, k_ref, v_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref, o_ref, lse_ref,
                     m_sc, l_sc, acc_sc, *, c: _Static):
  bq, d = q_ref.shape
  kb, reached, tile_mask_fn = _key_tile(c, q_ref, k_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref)

  @pl.when(kb == 0)
  def _():
    m_sc[...], l_sc[...], acc_sc[...] = _init_stats(bq, d)

  @pl.when(reached)
  def _():
    mask = tile_mask_fn()
    carry = (m_sc[...], l_sc[...], acc_sc[...])
    m_sc[...], l_sc[...], acc_sc[...] = _skip_empty(
        c, mask, lambda cr: _online_softmax_step(cr, q_ref[...], k_ref[...], v_ref[...], mask, c.scale), carry)

  @pl.when(kb == pl.num_programs(3) - 1)
  def _():
    out, lse = _finish(m_sc[...], l_sc[...], acc_sc[...])
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_grid_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref,
                    dq_ref, dq_sc, *, c: _Static):
  kb, reached, tile_mask_fn = _key_tile(c, q_ref, k_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref)

  @pl.when(kb == 0)
  def _():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  @pl.when(reached)
  def _():
    mask = tile_mask_fn()

    def compute(dq):
      _, ds = _probs_and_dscores(q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...], delta_ref[...],
                                 mask, c.scale)
      return dq + _dot(ds.astype(k_ref.dtype), k_ref[...])

    dq_sc[...] = _skip_empty(c, mask, compute, dq_sc[...])

  @pl.when(kb == pl.num_programs(3) - 1)
  def _():
    dq_ref[...] = (dq_sc[...] * c.scale).astype(dq_ref.dtype)


def _dkv_grid_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, qend_ref, kvseg_ref, valid_ref,
                     dk_ref, dv_ref, dk_sc, dv_sc, *, c: _Static):
  bq = q_ref.shape[0]
  bk = k_ref.shape[0]
  kb, qb = pl.program_id(2), pl.program_id(3)
  k_lo = kb * bk
  first, last = q_tile_range(c.spec, k_lo, k_lo + bk, l=c.l, s=c.s, block_q=bq, num_q_blocks=pl.num_programs(3))

  @pl.when(qb == 0)
  def _():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  @pl.when(_in_range(c, first, last, qb))
  def _():
    mask = _mask(c, qb * bq, k_lo, bq, bk, qseg_ref[...], qend_ref[...], kvseg_ref[...], valid_ref[...])

    def compute(carry):
      dk, dv = carry
      q, do = q_ref[...], do_ref[...]
      p, ds = _probs_and_dscores(q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], mask, c.scale)
      return dk + _dot(ds.astype(q.dtype), q, ta=True), dv + _dot(p.astype(do.dtype), do, ta=True)

    dk_sc[...], dv_sc[...] = _skip_empty(c, mask, compute, (dk_sc[...], dv_sc[...]))

  @pl.when(qb == pl.num_programs(3) - 1)
  def _():
    dk_ref[...] = (dk_sc[...] * c.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


# --- pallas_call plumbing ---------------------------------------------------

def _compiler_params(c: _Static, semantics):
  if c.interpret:
    return None
  if c.backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=semantics)
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _scratch(c: _Static, *shapes):
  from jax.experimental.pallas import tpu as pltpu
  return [pltpu.VMEM(shape, jnp.float32) for shape in shapes]


def _call(kernel, c: _Static, grid, in_specs, out_specs, out_shape, scratch=(), semantics=None):
  kw = {"scratch_shapes": list(scratch)} if scratch else {}
  return pl.pallas_call(functools.partial(kernel, c=c), grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=c.interpret,
                        compiler_params=_compiler_params(c, semantics), **kw)


def _spec(shape, index_map):
  return pl.BlockSpec(shape, index_map)


def _forward(c: _Static, q, k, v, rows):
  """q [b, h, lp, d], k/v [b, g, sp, d] (padded); returns o like q and lse [b, h, lp, 1]."""
  b, h, lp, d = q.shape
  g, sp = k.shape[1], k.shape[2]
  r = h // g
  bq, bk = _fit(c.blocks.block_q, c.l), _fit(c.blocks.block_k, c.s)
  q_seg, q_end, kv_seg, valid = rows
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, lp, 1), jnp.float32)]
  if c.backend == "gpu":
    grid = (b, h, lp // bq)
    qmap = lambda bi, hi, i: (bi, hi, i, 0)
    in_specs = [_spec((None, None, bq, d), qmap), _spec((None, None, sp, d), lambda bi, hi, i: (bi, hi // r, 0, 0)),
                _spec((None, None, sp, d), lambda bi, hi, i: (bi, hi // r, 0, 0)),
                _spec((None, bq, 1), lambda bi, hi, i: (bi, i, 0)), _spec((None, bq, 1), lambda bi, hi, i: (bi, i, 0)),
                _spec((None, 1, sp), lambda bi, hi, i: (bi, 0, 0)), _spec((None, 1, sp), lambda bi, hi, i: (bi, 0, 0))]
    out_specs = [_spec((None, None, bq, d), qmap), _spec((None, None, bq, 1), qmap)]
    return _call(_fwd_loop_kernel, c, grid, in_specs, out_specs, out_shape)(q, k, v, q_seg, q_end, kv_seg, valid)
  grid = (b, h, lp // bq, sp // bk)
  qmap = lambda bi, hi, i, j: (bi, hi, i, 0)
  kmap = lambda bi, hi, i, j: (bi, hi // r, j, 0)
  in_specs = [_spec((None, None, bq, d), qmap), _spec((None, None, bk, d), kmap), _spec((None, None, bk, d), kmap),
              _spec((None, bq, 1), lambda bi, hi, i, j: (bi, i, 0)),
              _spec((None, bq, 1), lambda bi, hi, i, j: (bi, i, 0)),
              _spec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, j)), _spec((None, 1, bk), lambda bi, hi, i, j: (bi, 0, j))]
  out_specs = [_spec((None, None, bq, d), qmap), _spec((None, None, bq, 1), qmap)]
  return _call(_fwd_grid_kernel, c, grid, in_specs, out_specs, out_shape,
               scratch=_scratch(c, (bq, 1), (bq, 1), (bq, d)),
               semantics=("parallel", "parallel", "parallel", "arbitrary"))(q, k, v, q_seg, q_end, kv_seg, valid)


def _backward(c: _Static, q, k, v, o, lse, do, rows):
  b, h, lp, d = q.shape
  g, sp = k.shape[1], k.shape[2]
  r = h // g
  q_seg, q_end, kv_seg, valid = rows
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
  args = (q, k, v, do, lse, delta, q_seg, q_end, kv_seg, valid)
  # dq: query tiles outer; keys inner.
  bq, bk = _fit(c.blocks.block_q_dq, c.l), _fit(c.blocks.block_k_dq, c.s)
  if c.backend == "gpu":
    qm = lambda bi, hi, i: (bi, hi, i, 0)
    km = lambda bi, hi, i: (bi, hi // r, 0, 0)
    rm = lambda bi, hi, i: (bi, i, 0)
    cm = lambda bi, hi, i: (bi, 0, 0)
    specs = [_spec((None, None, bq, d), qm), _spec((None, None, sp, d), km), _spec((None, None, sp, d), km),
             _spec((None, None, bq, d), qm), _spec((None, None, bq, 1), qm), _spec((None, None, bq, 1), qm),
             _spec((None, bq, 1), rm), _spec((None, bq, 1), rm), _spec((None, 1, sp), cm), _spec((None, 1, sp), cm)]
    dq = _call(_dq_loop_kernel, c, (b, h, lp // bq), specs, _spec((None, None, bq, d), qm),
               jax.ShapeDtypeStruct(q.shape, q.dtype))(*args)
  else:
    qm = lambda bi, hi, i, j: (bi, hi, i, 0)
    km = lambda bi, hi, i, j: (bi, hi // r, j, 0)
    rm = lambda bi, hi, i, j: (bi, i, 0)
    cm = lambda bi, hi, i, j: (bi, 0, j)
    specs = [_spec((None, None, bq, d), qm), _spec((None, None, bk, d), km), _spec((None, None, bk, d), km),
             _spec((None, None, bq, d), qm), _spec((None, None, bq, 1), qm), _spec((None, None, bq, 1), qm),
             _spec((None, bq, 1), rm), _spec((None, bq, 1), rm), _spec((None, 1, bk), cm), _spec((None, 1, bk), cm)]
    dq = _call(_dq_grid_kernel, c, (b, h, lp // bq, sp // bk), specs, _spec((None, None, bq, d), qm),
               jax.ShapeDtypeStruct(q.shape, q.dtype), scratch=_scratch(c, (bq, d)),
               semantics=("parallel", "parallel", "parallel", "arbitrary"))(*args)
  # dk, dv per query head (summed over each kv head's group below): key tiles outer.
  bq, bk = _fit(c.blocks.block_q_dkv, c.l), _fit(c.blocks.block_k_dkv, c.s)
  kv_shape = jax.ShapeDtypeStruct((b, h, sp, d), jnp.float32)
  if c.backend == "gpu":
    qm = lambda bi, hi, j: (bi, hi, 0, 0)
    km = lambda bi, hi, j: (bi, hi // r, j, 0)
    om = lambda bi, hi, j: (bi, hi, j, 0)
    rm = lambda bi, hi, j: (bi, 0, 0)
    cm = lambda bi, hi, j: (bi, 0, j)
    specs = [_spec((None, None, lp, d), qm), _spec((None, None, bk, d), km), _spec((None, None, bk, d), km),
             _spec((None, None, lp, d), qm), _spec((None, None, lp, 1), qm), _spec((None, None, lp, 1), qm),
             _spec((None, lp, 1), rm), _spec((None, lp, 1), rm), _spec((None, 1, bk), cm), _spec((None, 1, bk), cm)]
    dk, dv = _call(_dkv_loop_kernel, c, (b, h, sp // bk), specs,
                   [_spec((None, None, bk, d), om), _spec((None, None, bk, d), om)], [kv_shape, kv_shape])(*args)
  else:
    qm = lambda bi, hi, j, i: (bi, hi, i, 0)
    km = lambda bi, hi, j, i: (bi, hi // r, j, 0)
    om = lambda bi, hi, j, i: (bi, hi, j, 0)
    rm = lambda bi, hi, j, i: (bi, i, 0)
    cm = lambda bi, hi, j, i: (bi, 0, j)
    specs = [_spec((None, None, bq, d), qm), _spec((None, None, bk, d), km), _spec((None, None, bk, d), km),
             _spec((None, None, bq, d), qm), _spec((None, None, bq, 1), qm), _spec((None, None, bq, 1), qm),
             _spec((None, bq, 1), rm), _spec((None, bq, 1), rm), _spec((None, 1, bk), cm), _spec((None, 1, bk), cm)]
    dk, dv = _call(_dkv_grid_kernel, c, (b, h, sp // bk, lp // bq), specs,
                   [_spec((None, None, bk, d), om), _spec((None, None, bk, d), om)], [kv_shape, kv_shape],
                   scratch=_scratch(c, (bk, d), (bk, d)),
                   semantics=("parallel", "parallel", "parallel", "arbitrary"))(*args)
  dk = dk.reshape(b, g, r, sp, d).sum(axis=2).astype(k.dtype)
  dv = dv.reshape(b, g, r, sp, d).sum(axis=2).astype(v.dtype)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(c: _Static, q, k, v, rows):
  return _forward(c, q, k, v, rows)[0]


def _flash_fwd(c, q, k, v, rows):
  o, lse = _forward(c, q, k, v, rows)
  return o, (q, k, v, o, lse, rows)


def _flash_bwd(c, res, do):
  q, k, v, o, lse, rows = res
  dq, dk, dv = _backward(c, q, k, v, o, lse, do, rows)
  return dq, dk, dv, jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), rows)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x, axis: int, n: int, value=0):
  if x.shape[axis] == n:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def flash_attention(
    q: Float[Array, "b l h d"],
    k: Float[Array, "b s g d"],
    v: Float[Array, "b s g d"],
    mask: AttentionMask | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
    backend: str = "gpu",
    interpret: bool = False,
) -> Float[Array, "b l h d"]:
  """Flash attention with a structural mask; shapes and semantics as
  `attention_reference` (grouped-query heads included), differentiable in
  q, k and v. `backend` picks the kernel variant ("gpu" or "tpu"); `interpret`
  runs it with the Pallas interpreter (any backend, slow: tests)."""
  if backend not in BACKENDS:
    raise ValueError(f"unknown flash attention backend {backend!r}; choose from {BACKENDS}")
  b, l, h, d = q.shape
  s, g = k.shape[1], k.shape[2]
  mask = resolve(mask, causal, q.shape, k.shape)
  blocks = block_sizes or BlockSizes.get_default(backend)
  c = _Static(spec=mask.spec, l=l, s=s, scale=float(d ** -0.5 if scale is None else scale), blocks=blocks,
              backend=backend, interpret=interpret)
  # Every tile size of an axis divides its padded length (they are powers of two).
  lp = _round_up(l, max(_fit(x, l) for x in (blocks.block_q, blocks.block_q_dkv, blocks.block_q_dq)))
  sp = _round_up(s, max(_fit(x, s) for x in (blocks.block_k, blocks.block_k_dkv, blocks.block_k_dq)))

  def per_row(x, n, fill, length):
    """A [b, length] int32 array (or `fill` when absent), zero-padded to n."""
    return _pad_to(jnp.broadcast_to(jnp.asarray(fill if x is None else x, jnp.int32), (b, length)), 1, n)

  q_seg = per_row(mask.q_segment_ids, lp, 0, l)[:, :, None]
  q_end = per_row(mask.q_end, lp, 0, l)[:, :, None]
  kv_seg = per_row(mask.kv_segment_ids, sp, 0, s)[:, None, :]
  valid = per_row(mask.kv_valid, sp, 1, s)[:, None, :]
  qt = _pad_to(q.transpose(0, 2, 1, 3), 2, lp)
  kt = _pad_to(k.transpose(0, 2, 1, 3), 2, sp)
  vt = _pad_to(v.transpose(0, 2, 1, 3), 2, sp)
  out = _flash(c, qt, kt, vt, (q_seg, q_end, kv_seg, valid))
  return out[:, :, :l].transpose(0, 2, 1, 3)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m
