"""Attention masks described by structure, so a kernel can build each tile's
mask from indices and small per-row arrays (and skip tiles nobody reads)
instead of streaming a materialised [L, S] boolean array.

Query i may read key j when all of these hold:
  kind "full":             always
  kind "causal":           j <= i + (S - L)   (queries are the last L keys)
  kind "block_diffusion":  the BD3-LM training mask over [x_t ; x_0], each half
                           S / 2 long, blocks of `block_size`: noisy block b reads
                           noisy block b and clean blocks < b; clean block b reads
                           clean blocks <= b
  kind "block_diffusion_causal": the same, but clean token i reads clean tokens <= i
                           (the clean context computed as an AR model computes it:
                           an adapted AR model's prefix stays its base's)
  kind "prefix":           j < q_end[i]       (a KV cache: each query reads a prefix
                           of the slots, see `KVCache.attention_mask`)
  and, where given: kv_valid[j], and q_segment_ids[i] == kv_segment_ids[j]
  (packed sequences).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Int

KINDS = ("full", "causal", "block_diffusion", "block_diffusion_causal", "prefix")
BLOCK_KINDS = ("block_diffusion", "block_diffusion_causal")  # the [x_t ; x_0] training layouts


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of a mask: what a kernel specialises on."""

  kind: str = "full"
  block_size: int = 0
  has_segments: bool = False
  has_valid: bool = False


@struct.dataclass
class AttentionMask:
  """A structural mask: static `kind`/`block_size` plus per-row arrays (a pytree)."""

  kind: str = struct.field(pytree_node=False, default="full")
  block_size: int = struct.field(pytree_node=False, default=0)
  q_segment_ids: Int[Array, "b l"] | None = None
  kv_segment_ids: Int[Array, "b s"] | None = None
  kv_valid: Bool[Array, "b s"] | None = None
  q_end: Int[Array, "b l"] | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"unknown mask kind {self.kind!r}; choose from {KINDS}")
    if self.kind in BLOCK_KINDS and self.block_size <= 0:
      raise ValueError(f"block_diffusion masks need block_size > 0, got {self.block_size}")
    if (self.kind == "prefix") != (self.q_end is not None):
      raise ValueError("q_end is given exactly for kind 'prefix'")
    if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
      raise ValueError("q_segment_ids and kv_segment_ids go together")

  @property
  def has_segments(self) -> bool:
    return self.q_segment_ids is not None

  @property
  def spec(self) -> MaskSpec:
    return MaskSpec(self.kind, self.block_size, self.has_segments, self.kv_valid is not None)

  def with_causal(self, causal: bool) -> "AttentionMask":
    """This mask and, when `causal`, the causal one (only 'full' combines)."""
    if not causal or self.kind == "causal":
      return self
    if self.kind != "full":
      raise ValueError(f"causal=True cannot be combined with a {self.kind!r} mask")
    return self.replace(kind="causal")

  def check(self, l: int, s: int) -> None:
    if self.kind in BLOCK_KINDS and (l != s or s % 2 or (s // 2) % self.block_size):
      raise ValueError(f"block_diffusion needs l == s == 2 * a multiple of block_size ({self.block_size}),"
                       f" got l={l}, s={s}")

  def dense(self, l: int, s: int) -> Bool[Array, "b 1 l s"]:
    """The materialised mask ([1, 1, l, s] when no per-row array is given)."""
    self.check(l, s)
    qi = jnp.arange(l, dtype=jnp.int32)[:, None]
    kj = jnp.arange(s, dtype=jnp.int32)[None, :]
    out = tile_mask(self, qi, kj, l=l, s=s, q_seg=_rows(self.q_segment_ids), kv_seg=_cols(self.kv_segment_ids),
                    kv_valid=_cols(self.kv_valid), q_end=_rows(self.q_end))
    return jnp.broadcast_to(out, (out.shape[0] if out.ndim == 3 else 1, l, s))[:, None]


def resolve(mask: "AttentionMask | None", causal: bool, q_shape, k_shape) -> "AttentionMask":
  """The mask an attention of these q [b, l, h, d] and k [b, s, g, d] shapes
  runs (combined with `causal`), checked against them."""
  (l, h), (s, g) = (q_shape[1], q_shape[2]), (k_shape[1], k_shape[2])
  if h % g:
    raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({g})")
  mask = (mask if mask is not None else AttentionMask()).with_causal(causal)
  mask.check(l, s)
  return mask


def _rows(x):
  return None if x is None else x[:, :, None]


def _cols(x):
  return None if x is None else x[:, None, :]


def tile_mask(spec: MaskSpec | AttentionMask, qi, kj, *, l: int, s: int, q_seg=None, kv_seg=None, kv_valid=None, q_end=None,
              bounds: bool = False):
  """True where query index `qi` may read key index `kj` (broadcasting).

  The one definition of the mask semantics: `AttentionMask.dense` and every
  kernel tile call it. The per-row arrays arrive already sliced to the
  tile and broadcastable against `qi` (rows) / `kj` (columns). With `bounds`,
  keys at or past `s` (block padding) are masked too."""
  allowed = None

  def both(a, b):
    return b if a is None else jnp.logical_and(a, b)

  if spec.kind == "causal":
    allowed = kj <= qi + (s - l)
  elif spec.kind in BLOCK_KINDS:
    half, bs = s // 2, spec.block_size
    q_noisy, k_noisy = qi < half, kj < half
    qb, kb = (qi % half) // bs, (kj % half) // bs
    clean = kj <= qi if spec.kind == "block_diffusion_causal" else kb <= qb
    allowed = jnp.where(q_noisy, jnp.where(k_noisy, qb == kb, kb < qb), jnp.logical_not(k_noisy) & clean)
  elif spec.kind == "prefix":
    allowed = kj < q_end
  if kv_valid is not None:
    allowed = both(allowed, kv_valid != 0)
  if q_seg is not None:
    allowed = both(allowed, q_seg == kv_seg)
  if bounds:
    allowed = both(allowed, kj < s)
  if allowed is None:
    allowed = jnp.ones(jnp.broadcast_shapes(jnp.shape(qi), jnp.shape(kj)), jnp.bool_)
  return allowed


def kv_tile_range(spec: MaskSpec, q_lo, q_hi, *, l: int, s: int, block_k: int, num_k_blocks: int,
                  q_end_max=None):
  """[first, last) key tiles that queries [q_lo, q_hi) may read: a superset of
  the tiles holding an allowed key (a tile inside it may still be empty)."""
  first, hi_key = 0, None
  q_hi = jnp.minimum(q_hi, l)
  if spec.kind == "causal":
    hi_key = q_hi + (s - l)
  elif spec.kind == "prefix":
    hi_key = q_end_max
  elif spec.kind in BLOCK_KINDS:  # the causal clean half reads a subset of the block one's keys
    half, bs = s // 2, spec.block_size
    r = q_hi - 1
    bn = jnp.minimum(r, half - 1) // bs
    hi_noisy = jnp.where(bn > 0, half + bn * bs, bs)  # own block, then clean blocks < bn
    hi_clean = half + ((r - half) // bs + 1) * bs  # clean blocks <= own
    hi_key = jnp.where(r >= half, jnp.where(q_lo < half, jnp.maximum(hi_noisy, hi_clean), hi_clean), hi_noisy)
    first = jnp.where(q_lo < half, (q_lo // bs) * bs, half) // block_k
  if hi_key is None:
    return first, num_k_blocks
  return first, jnp.clip((hi_key + block_k - 1) // block_k, 0, num_k_blocks)


def q_tile_range(spec: MaskSpec, k_lo, k_hi, *, l: int, s: int, block_q: int, num_q_blocks: int):
  """[first, last) query tiles that may read keys [k_lo, k_hi) (a superset)."""
  k_hi = jnp.minimum(k_hi, s)
  if spec.kind == "causal":
    return jnp.clip((k_lo - (s - l)) // block_q, 0, num_q_blocks), num_q_blocks
  if spec.kind in BLOCK_KINDS:
    half, bs = s // 2, spec.block_size
    # A noisy key is read by its own noisy block only; a clean key of block c
    # by noisy blocks > c and clean blocks >= c.
    first_row = jnp.where(k_lo >= half, ((k_lo - half) // bs + 1) * bs, (k_lo // bs) * bs)
    first_row = jnp.where((k_lo < half) & (k_hi > half), jnp.minimum(first_row, bs), first_row)  # clean block 0
    last_row = jnp.where(k_hi <= half, ((k_hi - 1) // bs + 1) * bs, 2 * half)
    return first_row // block_q, jnp.minimum(num_q_blocks, (last_row + block_q - 1) // block_q)
  return 0, num_q_blocks
