"""The serving engine's device state and the two programs that move it.

A fixed number of slots, each holding one request at its own point of
block-by-block diffusion decoding against its own row of a per-row KV cache.
`admit` prefills one slot's prompt; `step` runs one refinement pass over every
slot at once: each slot sends [its finished block, if any | its current
block], the finished block goes into the cache and the current block is
denoised in the same pass (`Transformer.forward_cached` with new_block).
Per-request settings (threshold, min tokens, temperature, seed, length) are
arrays rather than static arguments, so requests of different efforts share
every pass, and a request's noise depends only on its own seed, block and
step: its tokens do not depend on which slot it got or who else is decoding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from mdlm_jax.builder import ModelSpec, bind
from mdlm_jax.diffusion import NEG_INF
from mdlm_jax.kv_cache import KVCache
from mdlm_jax.sampling.gumbel import gumbel_argmax, random_words, top_p_filter
from mdlm_jax.sampling.samplers import rank_desc


@struct.dataclass
class Slots:
  cache: KVCache  # per-row fill points
  gen: Int[Array, "s g"]  # each slot's generation region ([MASK] where undecided)
  prompt_len: Int[Array, "s"]  # RoPE position of gen[:, 0]
  block: Int[Array, "s"]  # the block being refined
  step: Int[Array, "s"]  # refinement passes spent on it so far
  head: Bool[Array, "s"]  # the block before it is finished but not yet in the cache
  active: Bool[Array, "s"]  # holds a request that is still decoding
  n_blocks: Int[Array, "s"]  # blocks the request may decode
  threshold: Float[Array, "s"]
  min_tokens: Int[Array, "s"]
  temperature: Float[Array, "s"]
  top_p: Float[Array, "s"]
  key: jax.Array  # [s, 2] uint32: each request's PRNG key data
  passes: Int[Array, "s"]  # forward passes that carried the request


@dataclasses.dataclass(frozen=True)
class SlotConfig:
  """Static shapes: compiled once per engine."""
  num_slots: int
  block_size: int
  max_prompt: int  # prompt tokens a slot can hold (BOS included)
  max_new_tokens: int  # a multiple of block_size
  mask_id: int
  eos_id: int

  @property
  def cache_len(self) -> int:
    # The last step writes [finished block | current block] past the region's end.
    return self.max_prompt + self.max_new_tokens + self.block_size


def init_slots(spec: ModelSpec, sc: SlotConfig) -> Slots:
  s, g = sc.num_slots, sc.max_new_tokens
  zeros = lambda: jnp.zeros((s,), jnp.int32)  # noqa: E731  (distinct buffers: the state is donated)
  return Slots(cache=KVCache.init(spec.cfg, s, sc.cache_len, per_row=True),
               gen=jnp.full((s, g), sc.mask_id, jnp.int32), prompt_len=zeros(), block=zeros(), step=zeros(),
               head=jnp.zeros((s,), bool), active=jnp.zeros((s,), bool), n_blocks=zeros(),
               threshold=jnp.ones((s,), jnp.float32), min_tokens=jnp.ones((s,), jnp.int32),
               temperature=jnp.zeros((s,), jnp.float32), top_p=jnp.ones((s,), jnp.float32),
               key=jnp.zeros((s, 2), jnp.uint32), passes=zeros())


def _row_slice(x, row, axis):
  return lax.dynamic_slice_in_dim(x, row, 1, axis)


def _row_update(x, new, row, axis):
  return lax.dynamic_update_slice_in_dim(x, new.astype(x.dtype), row, axis)


def admit(spec: ModelSpec, sc: SlotConfig, params, slots: Slots, row, prompt: Int[Array, "p"], prompt_len,
          n_blocks, threshold, min_tokens, temperature, top_p, key_data) -> Slots:
  """Resets slot `row` and encodes `prompt[:prompt_len]` into its cache row."""
  model = bind(spec, params)
  c = slots.cache
  p = prompt.shape[0]
  sub = KVCache(k=_row_slice(c.k, row, 1), v=_row_slice(c.v, row, 1), valid=jnp.zeros((1, c.max_len), bool),
                length=jnp.zeros((1,), jnp.int32), last_hidden=jnp.zeros_like(_row_slice(c.last_hidden, row, 0)))
  valid_new = (jnp.arange(p) < prompt_len)[None]
  t = jnp.zeros((1,), jnp.float32) if spec.cfg.time_conditioning else None
  _, sub = model.forward_cached(prompt[None], jnp.arange(p, dtype=jnp.int32)[None], sub, commit=True,
                                valid_new=valid_new, t=t, commit_len=jnp.reshape(prompt_len, (1,)))
  cache = c.replace(k=_row_update(c.k, sub.k, row, 1), v=_row_update(c.v, sub.v, row, 1),
                    valid=_row_update(c.valid, sub.valid, row, 0), length=_row_update(c.length, sub.length, row, 0),
                    last_hidden=_row_update(c.last_hidden, sub.last_hidden, row, 0))
  one = lambda x, v: x.at[row].set(jnp.asarray(v, x.dtype))  # noqa: E731
  return slots.replace(
      cache=cache, gen=slots.gen.at[row].set(sc.mask_id), prompt_len=one(slots.prompt_len, prompt_len),
      block=one(slots.block, 0), step=one(slots.step, 0), head=one(slots.head, False),
      active=one(slots.active, True), n_blocks=one(slots.n_blocks, n_blocks),
      threshold=one(slots.threshold, threshold), min_tokens=one(slots.min_tokens, min_tokens),
      temperature=one(slots.temperature, temperature), top_p=one(slots.top_p, top_p),
      key=slots.key.at[row].set(key_data), passes=one(slots.passes, 1))


def cancel(slots: Slots, row) -> Slots:
  return slots.replace(active=slots.active.at[row].set(False))


def _propose(logits, key_data, block, step, temperature, top_p, mask_id):
  """Per row: proposals (Gumbel-max at the row's temperature over its top-p
  nucleus; argmax at temperature 0) and their untempered probabilities."""
  logits = logits.astype(jnp.float32).at[..., mask_id].set(NEG_INF)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sampled():
    keys = jax.vmap(lambda k, b, s: jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(k), b), s))(
        key_data, block, step)
    words = jax.vmap(lambda k: random_words(k, logits.shape[1:]))(keys)  # [s, 2, t, v]
    safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
    scaled = logits / safe_t
    scaled = lax.cond(jnp.any(top_p < 1), lambda: top_p_filter(scaled, top_p[:, None, None]), lambda: scaled)
    x = gumbel_argmax(scaled, jnp.moveaxis(words, 1, 0))
    return jnp.where((temperature > 0)[:, None], x, greedy)

  x0 = lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)
  logp = jax.nn.log_softmax(logits, axis=-1)
  conf = jnp.exp(jnp.take_along_axis(logp, x0[..., None], axis=-1)[..., 0])
  return x0, conf


def step(spec: ModelSpec, sc: SlotConfig, params, s: Slots, with_head: bool = True) -> Slots:
  """One refinement pass over every slot (idle slots ride along, committing nothing).

  with_head=True: each slot sends [its finished block, if any | its current
  block], and the finished blocks go into the cache. with_head=False: a pass
  half as long, current blocks only; slots whose finished block still waits
  for the cache sit this pass out unchanged. A block's second and later passes
  need no head, so the engine alternates the two and no pass carries a
  finished-block's worth of dead tokens for every slot."""
  model = bind(spec, params)
  bs = sc.block_size
  lo = s.block * bs
  take = jax.vmap(lambda row, start: lax.dynamic_slice_in_dim(row, start, bs))
  tail = take(s.gen, jnp.minimum(lo, sc.max_new_tokens - bs))
  tail_pos = (s.prompt_len + lo)[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
  t = jnp.mean(tail == sc.mask_id, axis=-1).astype(jnp.float32) if spec.cfg.time_conditioning else None
  if with_head:
    moving = s.active
    prev = take(s.gen, jnp.maximum(lo - bs, 0))
    head_valid = s.head & s.active
    tokens = jnp.concatenate([prev, tail], axis=1)
    positions = jnp.concatenate([jnp.maximum(tail_pos - bs, 0), tail_pos], axis=1)
    # An idle row still sees its own tail: no query ever has nothing to attend to.
    valid_new = jnp.concatenate([jnp.broadcast_to(head_valid[:, None], prev.shape), jnp.ones_like(tail, bool)], 1)
    logits, cache = model.forward_cached(tokens, positions, s.cache, commit=True, valid_new=valid_new, t=t,
                                         commit_len=jnp.where(head_valid, bs, 0), new_block=bs)
  else:
    moving = s.active & ~s.head
    # Committing 0 tokens: the tail's keys are written past each fill point,
    # where nothing reads them, into the donated cache in place. (commit=False
    # hands back the input cache, so the write would need a copy of all of it.)
    logits, cache = model.forward_cached(tail, tail_pos, s.cache, commit=True, t=t,
                                         commit_len=jnp.zeros_like(s.prompt_len))
  x0, conf = _propose(logits, s.key, s.block, s.step, s.temperature, s.top_p, sc.mask_id)
  candidates = (tail == sc.mask_id) & moving[:, None]
  conf = jnp.where(candidates, conf, -1.0)
  top = rank_desc(conf) < s.min_tokens[:, None]
  commit = candidates & ((conf >= s.threshold[:, None]) | top)
  new_tail = jnp.where(commit, x0, tail)
  put = jax.vmap(lambda row, blk, start: lax.dynamic_update_slice_in_dim(row, blk, start, 0))
  gen = jnp.where(moving[:, None], put(s.gen, new_tail, jnp.minimum(lo, sc.max_new_tokens - bs)), s.gen)
  finished = moving & ~jnp.any(new_tail == sc.mask_id, axis=-1)
  done = finished & (jnp.any(new_tail == sc.eos_id, axis=-1) | (s.block + 1 >= s.n_blocks))
  return s.replace(cache=cache, gen=gen, block=jnp.where(finished, s.block + 1, s.block),
                   step=jnp.where(finished, 0, jnp.where(moving, s.step + 1, s.step)),
                   head=jnp.where(moving, finished & ~done, s.head & s.active), active=s.active & ~done,
                   passes=s.passes + moving.astype(jnp.int32))


def _map_rows(fn, s: Slots, *others: Slots) -> Slots:
  """fn(array, slot_axis, *matching arrays of `others`) over every slot-indexed
  array of the state (the cache's keys/values have the slot axis at 1)."""
  def one(get, axis):
    return fn(get(s), axis, *(get(o) for o in others))

  cache = s.cache.replace(**{name: one(lambda x, name=name: getattr(x.cache, name), 1 if name in ("k", "v") else 0)
                             for name in ("k", "v", "valid", "length", "last_hidden")})
  rest = {f.name: one(lambda x, name=f.name: getattr(x, name), 0) for f in dataclasses.fields(s) if f.name != "cache"}
  return s.replace(cache=cache, **rest)


def step_first(spec: ModelSpec, sc: SlotConfig, rows: int, params, s: Slots, with_head: bool = True) -> Slots:
  """`step` over slots [0, rows) only: requests take the lowest free slots, so
  a lightly loaded engine runs passes as small as its load."""
  if rows == sc.num_slots:
    return step(spec, sc, params, s, with_head)
  head = step(spec, sc, params, _map_rows(lambda x, axis: lax.slice_in_dim(x, 0, rows, axis=axis), s), with_head)
  out = _map_rows(lambda x, axis, new: lax.dynamic_update_slice_in_dim(x, new, 0, axis), s, head)
  # A pass without head commits nothing to the cache. Writing its unchanged
  # rows back would make XLA copy the whole cache (twice) to order the read
  # before the in-place update: most of such a pass's time at a light load.
  if not with_head:
    return out.replace(cache=s.cache)
  # A pass with head committed at most a block at each row's fill point: only
  # that window goes back, not the rows' whole cache (what it wrote after the
  # window lies past the fill point, where nothing reads it).
  w = sc.block_size
  start = jnp.minimum(s.cache.length[:rows], sc.cache_len - w)

  def put_row(r, kv):
    k, v = kv
    new_k = lax.dynamic_slice_in_dim(lax.dynamic_slice_in_dim(head.cache.k, r, 1, axis=1), start[r], w, axis=4)
    new_v = lax.dynamic_slice_in_dim(lax.dynamic_slice_in_dim(head.cache.v, r, 1, axis=1), start[r], w, axis=3)
    return (lax.dynamic_update_slice(k, new_k, (0, r, 0, 0, start[r])),
            lax.dynamic_update_slice(v, new_v, (0, r, 0, start[r], 0)))

  k, v = lax.fori_loop(0, rows, put_row, (s.cache.k, s.cache.v))
  return out.replace(cache=out.cache.replace(k=k, v=v))


def compile_programs(spec: ModelSpec, sc: SlotConfig):
  """(admit, step_first) jitted, with the slot state donated so it is updated
  in place; step_first(params, state, rows=k, with_head=h) compiles once per (k, h)."""
  return (jax.jit(functools.partial(admit, spec, sc), donate_argnums=(1,)),
          jax.jit(lambda params, state, rows, with_head=True: step_first(spec, sc, rows, params, state, with_head),
                  donate_argnums=(1,), static_argnames=("rows", "with_head")))
