"""A fixed-shape key/value cache for incremental decoding.

Every buffer has its final shape from the start, so a decode loop carries the
cache through `lax.while_loop`/`scan` and a jitted step never retraces: new
keys are written with `dynamic_update_slice` at a traced offset, and a boolean
mask over the slots (instead of a growing length) says what a query may read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from mdlm_jax.kernels import AttentionMask
from mdlm_jax.model.precision import compute_dtype
from mdlm_jax.parallel.sharding import constrain

if TYPE_CHECKING:
  from mdlm_jax.model import ModelConfig

# Keys are kept as [layer, batch, head, dim, slot] and values as [layer,
# batch, head, slot, dim]: the layouts the attention matmuls read (q k^T and
# p v, batched over heads) without first copying every layer's cache.
K_AXES = (None, "batch", "act_kv_heads", None, "length")
V_AXES = (None, "batch", "act_kv_heads", "length", None)


@struct.dataclass
class KVCache:
  """Keys/values of every layer for `max_len` slots.

  Slots [0, length) are filled; `valid` marks which filled slots hold real
  tokens (a left-padded prompt fills its pad slots too, so that rows stay
  aligned, but they must never be attended to). `length` is a scalar (every
  row filled alike, as in one generate call) or one count per row [b] (a
  serving engine whose slots hold requests at different points). Keys are
  stored after RoPE, so a slot's position is baked in when written.

  `k` and `v` may hold more rows than `valid` and `length` (b): the cache is
  then the first b rows of those buffers, read and written in place (a pass
  over the first slots of a serving engine, with no copy of the rest).
  """

  k: Float[Array, "n b g d s"]  # g: kv heads (fewer than query heads under GQA)
  v: Float[Array, "n b g s d"]
  valid: Bool[Array, "b s"]
  length: Int[Array, ""] | Int[Array, "b"]
  # Final hidden state of the last filled slot: what a shifted head
  # (ModelConfig.shift_logits) scores the next token from.
  last_hidden: Float[Array, "b d"]

  @classmethod
  def init(cls, cfg: "ModelConfig", batch: int, max_len: int, *, per_row: bool = False) -> "KVCache":
    n, g, d = cfg.num_layers, cfg.resolved_kv_heads, cfg.resolved_head_dim
    dt = compute_dtype(cfg.dtype)
    return cls(k=constrain(jnp.zeros((n, batch, g, d, max_len), dt), K_AXES),
               v=constrain(jnp.zeros((n, batch, g, max_len, d), dt), V_AXES),
               valid=constrain(jnp.zeros((batch, max_len), jnp.bool_), ("batch", "length")),
               length=jnp.zeros((batch,) if per_row else (), jnp.int32),
               last_hidden=constrain(jnp.zeros((batch, cfg.embed_dim), dt), ("batch", "act_embed")))

  @property
  def per_row(self) -> bool:
    return self.length.ndim == 1

  def _at_length(self, buf, new, axis: int):
    """Writes `new` into `buf` at each row's fill point along `axis` (batch is axis 0)."""
    if not self.per_row:
      return jax.lax.dynamic_update_slice_in_dim(buf, new, self.length, axis)
    return jax.vmap(lambda b, n, o: jax.lax.dynamic_update_slice_in_dim(b, n, o, axis - 1))(buf, new, self.length)

  @staticmethod
  def bytes_per_token(cfg: "ModelConfig") -> int:
    """Bytes one cached token takes: keys and values of every layer, in the compute dtype."""
    return 2 * cfg.num_layers * cfg.resolved_kv_heads * cfg.resolved_head_dim * jnp.dtype(
        compute_dtype(cfg.dtype)).itemsize

  @property
  def max_len(self) -> int:
    return self.v.shape[3]

  def attention_mask(self, valid_new: Bool[Array, "b t"], *, causal: bool, new_block: int = 0
                     ) -> tuple[Bool[Array, "b s"], Bool[Array, "b 1 t s"]]:
    """`attention_spec` with the mask materialised, [b, 1, t, s]."""
    valid, spec = self.attention_spec(valid_new, causal=causal, new_block=new_block)
    return valid, spec.dense(valid_new.shape[1], self.max_len)

  def attention_spec(self, valid_new: Bool[Array, "b t"], *, causal: bool, new_block: int = 0,
                     clean: Bool[Array, "b t"] | None = None) -> tuple[Bool[Array, "b s"], AttentionMask]:
    """Which slots the t new tokens (to be written at [length, length + t)) may read.

    Returns the slot validity with the new tokens' entries written in, and the mask:
    valid filled slots, plus the new tokens themselves: all of them; or those
    up to the query when causal; or, with `new_block` > 0, the new tokens split
    into a head (all but the last `new_block`, e.g. a finished block or the
    prompt, to be committed) that reads only itself, and a tail block that
    reads everything. Slots past length + t are never visible, so
    stale entries beyond the fill point (e.g. an uncommitted block) are ignored.
    `clean` (an adapted AR model, ModelConfig.clean_causal): those new tokens
    read causally whatever else holds, as the base model read its context.
    Each query reads a prefix of the slots (those valid), so the mask is a
    structural "prefix" mask: one end slot per query.
    """
    b, t = valid_new.shape
    if t > self.max_len:
      raise ValueError(f"{t} new tokens do not fit a cache of {self.max_len} slots")
    valid = self._at_length(self.valid, valid_new.astype(jnp.bool_), 1)
    start = jnp.reshape(self.length, (-1, 1))  # [b or 1, 1]
    query_slot = start + jnp.arange(t, dtype=jnp.int32)[None, :]
    if causal:
      q_end = query_slot + 1
    elif new_block > 0:
      if new_block > t:
        raise ValueError(f"new_block ({new_block}) is longer than the {t} new tokens")
      head_end = start + t - new_block
      q_end = jnp.where(query_slot >= head_end, start + t, head_end)
    else:
      q_end = start + t + jnp.zeros((1, t), jnp.int32)
    if clean is not None:
      q_end = jnp.where(clean, query_slot + 1, q_end)
    q_end = jnp.broadcast_to(q_end, (b, t)).astype(jnp.int32)
    return valid, AttentionMask(kind="prefix", q_end=q_end, kv_valid=valid)

  def write(self, layer: int, k: Float[Array, "b t g d"], v: Float[Array, "b t g d"]) -> "KVCache":
    """Writes one layer's new keys/values at [length, length + t); `length` is not advanced.

    The caller must leave room: with one fill point for all rows,
    `dynamic_update_slice` clamps an offset that would run past max_len; with
    one per row, slots past max_len are dropped."""
    if not self.per_row:
      k = k.transpose(0, 2, 3, 1).astype(self.k.dtype)  # [b, g, d, t]
      v = v.transpose(0, 2, 1, 3).astype(self.v.dtype)  # [b, g, t, d]
      nk = jax.lax.dynamic_update_slice(self.k, k[None], (layer, 0, 0, 0, self.length))
      nv = jax.lax.dynamic_update_slice(self.v, v[None], (layer, 0, 0, self.length, 0))
    else:
      # One in-place scatter of the t new slots of every row, [b, t, g, d]
      # updates at (layer, row, :, :, length[row] + j): writing the layer's
      # rows one by one (a vmapped dynamic_update_slice) rewrites the whole
      # layer, which on CPU cost a fifth of a 16-row serving pass.
      rows = jnp.arange(k.shape[0], dtype=jnp.int32)[:, None]
      slots = self.length[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
      nk = self.k.at[layer, rows, :, :, slots].set(k.astype(self.k.dtype), mode="drop")
      nv = self.v.at[layer, rows, :, slots, :].set(v.astype(self.v.dtype), mode="drop")
    return self.replace(k=constrain(nk, K_AXES), v=constrain(nv, V_AXES))

  def layer(self, layer: int) -> tuple[Float[Array, "b s g d"], Float[Array, "b s g d"]]:
    """One layer's keys and values as [b, s, g, d], the attention kernels' layout
    (transposed views: the reference attention's own transposes undo them)."""
    k = constrain(self.k[layer], K_AXES[1:]).transpose(0, 3, 1, 2)
    v = constrain(self.v[layer], V_AXES[1:]).transpose(0, 2, 1, 3)
    return k, v

  def kept_valid(self, valid: Bool[Array, "b s"], keep) -> Bool[Array, "b s"]:
    """`valid` with every slot past each row's length + keep cleared."""
    end = jnp.reshape(self.length + jnp.asarray(keep, jnp.int32), (-1, 1))
    return valid & (jnp.arange(self.max_len, dtype=jnp.int32)[None, :] < end)

  def commit(self, valid: Bool[Array, "b s"], t) -> "KVCache":
    """Marks the t slots written by the last forward as filled (t: an int, or
    one count per row [b] for a per-row cache)."""
    t = jnp.asarray(t, jnp.int32)
    if t.ndim and not self.per_row:
      raise ValueError("per-row commit counts need a per-row cache (KVCache.init(..., per_row=True))")
    return self.replace(valid=constrain(valid, ("batch", "length")), length=self.length + t)
