"""Attention in plain JAX whose memory grows linearly with the sequence.

The reference materialises [L, S] scores per head, so a 128K context needs
terabytes. Here queries go in blocks and, for each, keys in blocks with an
online softmax (a running max, sum and weighted sum per query row), as flash
attention does on GPU/TPU; the backward pass recomputes each tile's
probabilities from the saved log-sum-exp instead of storing them, so
training memory is linear too. Masks are the structural `AttentionMask`s:
each tile's mask is built from indices by `masks.tile_mask`, the definition
the kernels share. XLA-only, so it runs on every backend: the fallback where
no Pallas kernel applies (CPU) once sequences are long.

Key tiles no query of a tile may read (past the diagonal of a causal mask,
outside a BD3 block's reach, past the filled prefix of a KV cache) are
skipped, as the kernels skip them. A query row that may read no key gets
zeros, as from the kernels (the reference averages every value there).

`chunked_cache_attention` reads one layer of a KV cache in the layout it is
stored in, tile by tile: a decoding pass then costs what the cache's filled
prefix costs, not a transposed (and padded) copy of the whole buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from mdlm_jax.kernels.masks import AttentionMask, MaskSpec, kv_tile_range, resolve, tile_mask

_MIN = float(jnp.finfo(jnp.float32).min)


def chunked_attention(q: Float[Array, "b l h d"], k: Float[Array, "b s g d"], v: Float[Array, "b s g d"],
                      mask: AttentionMask | None = None, *, causal: bool = False, block_q: int = 128,
                      block_k: int = 128, scale: float | None = None, q_offset=0,
                      q_total: int | None = None) -> Float[Array, "b l h d"]:
  """`attention_reference` with [block_q, block_k] score tiles (see module doc).

  `q` may be a slice of a longer query sequence, as one device's share under
  sequence parallelism: rows `q_offset` (traced) onwards of `q_total` queries,
  against all the keys. Structural masks are evaluated at those global rows;
  the mask's per-row arrays (`q_segment_ids`, `q_end`) cover the slice."""
  b, l, h, d = q.shape
  s, g = k.shape[1], k.shape[2]
  q_total = l if q_total is None else q_total
  mask = resolve(mask, causal, (b, q_total, h, d), k.shape)
  bq, bk = min(block_q, l), min(block_k, s)
  lp, sp = -(-l // bq) * bq, -(-s // bk) * bk
  scale = d ** -0.5 if scale is None else scale

  # [b, g, S, d] keys and values, heads-major like the queries.
  kt, vt = _pad(k, sp).transpose(0, 2, 1, 3), _pad(v, sp).transpose(0, 2, 1, 3)
  rows = (_pad(mask.q_segment_ids, lp), _pad(mask.q_end, lp))
  cols = (_pad(mask.kv_segment_ids, sp), _pad(mask.kv_valid, sp))
  offset = jnp.asarray(q_offset, jnp.int32)
  out = _attention(mask.spec, bq, bk, q_total, s, float(scale), _heads_major(q, lp, g), kt, vt, rows, cols, offset)
  return _tokens_major(out, l)


def chunked_cache_attention(q: Float[Array, "b l h d"], k_cache: Float[Array, "*n b g d s"],
                            v_cache: Float[Array, "*n b g s d"], mask: AttentionMask, *, layer=None,
                            block_q: int = 512, block_k: int = 512,
                            scale: float | None = None) -> Float[Array, "b l h d"]:
  """`chunked_attention(q, k, v, mask)` with keys and values as a KV cache
  stores them: [b, g, d, s] and [b, g, s, d], or every layer's ([n, ...],
  `KVCache.k`/`.v`) with `layer` the one to read, whose first b rows (b of
  q) are read: a pass over some of a cache's rows needs no copy of them
  either. Key tiles are sliced from
  the buffer where they lie (the last one shifted back to end at the
  buffer's end, its columns already read masked), so nothing the size of
  the buffer is copied (slicing one layer out first would copy it). Forward
  only: for decoding."""
  b, l, h, d = q.shape
  s, g = v_cache.shape[-2], v_cache.shape[-3]
  mask = resolve(mask, False, q.shape, (b, s, g, d))
  bq, bk = min(block_q, l), min(block_k, s)
  lp = -(-l // bq) * bq
  scale = d ** -0.5 if scale is None else scale
  rows = (_pad(mask.q_segment_ids, lp), _pad(mask.q_end, lp))
  out, _ = _forward(mask.spec, bq, bk, l, s, float(scale), _heads_major(q, lp, g), k_cache, v_cache, rows,
                    (mask.kv_segment_ids, mask.kv_valid), jnp.zeros((), jnp.int32), keys_transposed=True,
                    layer=layer)
  return _tokens_major(out, l)


def _pad(x, n: int, axis: int = 1):
  """x zero-padded to length n along `axis` (None stays None)."""
  if x is None or x.shape[axis] == n:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, widths)


def _heads_major(q, lp: int, g: int):
  """[b, l, h, d] queries padded to lp rows as [b, g, r, lp, d]: the r query
  heads that share each of the g kv heads together."""
  b, _, h, d = q.shape
  return _pad(q, lp).reshape(b, lp, g, h // g, d).transpose(0, 2, 3, 1, 4)


def _tokens_major(out, l: int):
  """`_heads_major`'s layout back to [b, l, h, d], the padding dropped."""
  b, g, r, lp, d = out.shape
  return out.transpose(0, 3, 1, 2, 4).reshape(b, lp, g * r, d)[:, :l]


def _tiles(x, n: int, axis: int):
  """x with `axis` split into tiles of n, the tile index moved to the front."""
  shape = x.shape[:axis] + (x.shape[axis] // n, n) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _untile(x, axis: int):
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _tile(x, j, n: int, axis: int):
  return None if x is None else jax.lax.dynamic_slice_in_dim(x, j * n, n, axis)


class _Tiling:
  """Where query tile i's rows and key tile j's columns are, and their mask."""

  def __init__(self, spec: MaskSpec, l: int, s: int, bq: int, bk: int, rows, cols, offset):
    self.spec, self.l, self.s, self.bq, self.bk, self.rows, self.cols = spec, l, s, bq, bk, rows, cols
    self.offset = offset  # the global row of local query 0

  def key_range(self, i, n_k: int):
    """[first, last) key tiles holding a key some row of query tile i may read."""
    q_end = _tile(self.rows[1], i, self.bq, 1)
    lo = self.offset + i * self.bq
    return kv_tile_range(self.spec, lo, lo + self.bq, l=self.l, s=self.s, block_k=self.bk,
                         num_k_blocks=n_k, q_end_max=None if q_end is None else jnp.max(q_end))

  def allowed(self, i, j, start=None):
    """The [B, 1, 1, bq, bk] mask of query tile i against key tile j, whose
    columns begin at `start` (default j * bk; earlier for a last tile moved
    back to end at the buffer's end: its columns before j * bk are masked)."""
    start = j * self.bk if start is None else start
    q_seg, q_end = (_tile(x, i, self.bq, 1) for x in self.rows)
    kv_seg, kv_valid = (None if x is None else jax.lax.dynamic_slice_in_dim(x, start, self.bk, 1) for x in self.cols)
    qi = (self.offset + i * self.bq + jnp.arange(self.bq, dtype=jnp.int32))[:, None]
    kj = (start + jnp.arange(self.bk, dtype=jnp.int32))[None, :]
    expand = lambda x, at: None if x is None else jnp.expand_dims(x, at)  # noqa: E731
    m = tile_mask(self.spec, qi, kj, l=self.l, s=self.s, q_seg=expand(q_seg, 2), kv_seg=expand(kv_seg, 1),
                  kv_valid=expand(kv_valid, 1), q_end=expand(q_end, 2), bounds=True)
    m = m & (kj >= j * self.bk)
    m = m if m.ndim == 3 else m[None]
    return m[:, None, None]


def _scores(qc, kc, allowed, keys_transposed: bool = False):
  sc = jnp.einsum("bgrqd,bgdk->bgrqk" if keys_transposed else "bgrqd,bgkd->bgrqk", qc, kc,
                  preferred_element_type=jnp.float32)
  return jnp.where(allowed, sc, _MIN)


def _unless_empty(allowed, visit, carry):
  """visit(carry), or carry as is where the tile's mask allows no key: the
  tiles inside a query tile's key range that hold no readable key (a BD3
  noisy tile's later noisy tiles, other documents' tiles under segment ids,
  padding) cost nothing."""
  return jax.lax.cond(jnp.any(allowed), visit, lambda c: c, carry)


def _forward(spec, bq, bk, l, s, scale, qt, kt, vt, rows, cols, offset, keys_transposed: bool = False,
             layer=None):
  """(out [b, g, r, L, d], lse [b, g, r, L]); a row that may read no key
  gets zeros and an infinite lse (so no gradient). Keys are [b, g, S, d], or
  [b, g, d, S] with `keys_transposed`; S need not be a multiple of bk. With
  `layer`, keys and values have a leading layer axis and that layer is read."""
  qs = qt * jnp.asarray(scale, qt.dtype)
  tiling = _Tiling(spec, l, s, bq, bk, rows, cols, offset)
  n_keys = vt.shape[-2]
  n_k = -(-n_keys // bk)

  def fetch(x, axis, start):
    """Key tile [start, start + bk) along `axis` of one layer's buffer."""
    if layer is None:
      return jax.lax.dynamic_slice_in_dim(x, start, bk, axis)
    index = [jnp.asarray(layer, jnp.int32)] + [jnp.zeros((), jnp.int32)] * (x.ndim - 1)
    index[axis + 1] = start
    sizes = [1, qt.shape[0], *x.shape[2:]]  # the queries' rows: the first of the buffer's
    sizes[axis + 1] = bk
    return jax.lax.dynamic_slice(x, index, sizes)[0]

  def q_tile(i):
    qc = _tile(qs, i, bq, 3)
    shape = qc.shape[:-1]

    def k_tile(j, carry):
      start = jnp.minimum(j * bk, n_keys - bk)
      allowed = tiling.allowed(i, j, start)

      def visit(carry):
        m, total, acc = carry
        kc, vc = fetch(kt, 3 if keys_transposed else 2, start), fetch(vt, 2, start)
        sc = _scores(qc, kc, allowed, keys_transposed)
        m_new = jnp.maximum(m, sc.max(-1))
        p = jnp.exp(sc - m_new[..., None])
        corr = jnp.exp(m - m_new)
        acc = acc * corr[..., None] + jnp.einsum("bgrqk,bgkd->bgrqd", p.astype(vc.dtype), vc,
                                                 preferred_element_type=jnp.float32)
        return m_new, total * corr + p.sum(-1), acc

      return _unless_empty(allowed, visit, carry)

    init = (jnp.full(shape, _MIN, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(qc.shape, jnp.float32))
    first, last = tiling.key_range(i, n_k)
    m, total, acc = jax.lax.fori_loop(first, last, k_tile, init)
    empty = m == _MIN  # every score it saw was masked
    out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, total)[..., None])
    return out.astype(vt.dtype), jnp.where(empty, jnp.inf, m + jnp.log(total))

  out, lse = jax.lax.map(q_tile, jnp.arange(qt.shape[3] // bq))
  return _untile(out, 3), _untile(lse, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _attention(spec, bq, bk, l, s, scale, qt, kt, vt, rows, cols, offset):
  return _forward(spec, bq, bk, l, s, scale, qt, kt, vt, rows, cols, offset)[0]


def _attention_fwd(spec, bq, bk, l, s, scale, qt, kt, vt, rows, cols, offset):
  out, lse = _forward(spec, bq, bk, l, s, scale, qt, kt, vt, rows, cols, offset)
  return out, (qt, kt, vt, rows, cols, offset, out, lse)


def _attention_bwd(spec, bq, bk, l, s, scale, res, dout):
  """Per query tile, per key tile it reads: p from the saved lse, then
  dV += p^T dO, dS = p (dO V^T - rowsum(dO O)), dQ += dS K, dK += dS^T Q."""
  qt, kt, vt, rows, cols, offset, out, lse = res
  qs = qt * jnp.asarray(scale, qt.dtype)
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  tiling = _Tiling(spec, l, s, bq, bk, rows, cols, offset)
  n_k = kt.shape[2] // bk

  def q_tile(carry, i):
    qc, do = _tile(qs, i, bq, 3), _tile(dout, i, bq, 3).astype(jnp.float32)
    lse_c, delta_c = _tile(lse, i, bq, 3), _tile(delta, i, bq, 3)

    def k_tile(j, inner):
      allowed = tiling.allowed(i, j)

      def visit(inner):
        dq, dk, dv = inner
        kc, vc = _tile(kt, j, bk, 2), _tile(vt, j, bk, 2)
        p = jnp.exp(_scores(qc, kc, allowed) - lse_c[..., None])
        dp = jnp.einsum("bgrqd,bgkd->bgrqk", do, vc, preferred_element_type=jnp.float32)
        ds = jnp.where(allowed, p * (dp - delta_c[..., None]), 0.0)
        add = lambda acc, new: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            acc, _tile(acc, j, bk, 2) + new, j * bk, 2)
        dv = add(dv, jnp.einsum("bgrqk,bgrqd->bgkd", p, do))
        dk = add(dk, jnp.einsum("bgrqk,bgrqd->bgkd", ds, qc.astype(jnp.float32)))
        return dq + jnp.einsum("bgrqk,bgkd->bgrqd", ds, kc.astype(jnp.float32)), dk, dv

      return _unless_empty(allowed, visit, inner)

    first, last = tiling.key_range(i, n_k)
    dq, dk, dv = jax.lax.fori_loop(first, last, k_tile, (jnp.zeros(qc.shape, jnp.float32), *carry))
    return (dk, dv), dq

  zeros = jnp.zeros(kt.shape, jnp.float32)
  (dk, dv), dq = jax.lax.scan(q_tile, (zeros, zeros), jnp.arange(qt.shape[3] // bq))
  dq = _untile(dq, 3) * scale
  return dq.astype(qt.dtype), dk.astype(kt.dtype), dv.astype(vt.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
