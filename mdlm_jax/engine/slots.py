"""The serving engine's device state and the two programs that move it.

A fixed number of slots, each holding one request at its own point of
block-by-block diffusion decoding against its own row of a per-row KV cache.
`admit` prefills the prompts of slots being (re)filled; `step` runs one
refinement pass over every slot at once: each slot sends [its finished
block, if any | its current block], the finished block goes into the cache
and the current block is denoised in the same pass (`Transformer.forward_cached` with new_block).
A revising slot (an adapted AR model, `rule.verify`) slides instead: it sends
[the base's next token and its drafts | a masked block after them] and keeps
what its base verifies, in the same passes (`Transformer.forward_speculative`).
Each slot's decoding settings are one row of a `rule.Decoding` (arrays, not
static arguments), so requests of different efforts share every pass; the
pass applies `sampling.rule`, the rule the one-shot samplers apply, and a
request's noise depends only on its own seed, block, step and columns: its
tokens do not depend on which slot it got or who else is decoding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from mdlm_jax import kernels
from mdlm_jax.engine import packing as packing_lib
from mdlm_jax.model.spec import ModelSpec, bind
from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.model.precision import compute_dtype
from mdlm_jax.sampling import draft_table, grammar, rule
from mdlm_jax.sampling.samplers import check_pass_widths


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
  max_tokens: Int[Array, "s"]  # tokens it may keep: a revising row, which slides, ends there
  decoding: rule.Decoding  # each request's settings of the refinement rule
  key: jax.Array  # [s, 2] uint32: each request's PRNG key data
  passes: Int[Array, "s"]  # forward passes that carried the request
  # Revising rows (decoding.revise) slide instead of stepping through blocks:
  # `filled` tokens kept in order; the next pass's head is `ahead`, the base's
  # next token and `n_ahead` drafts (-1: empty, right after the prompt).
  filled: Int[Array, "s"]
  ahead: Int[Array, "s b"]
  n_ahead: Int[Array, "s"]
  # The prompt's last `SlotConfig.lookup_window` tokens, right-aligned (-1
  # before them): what revising rows copy drafts from (`rule.lookup_drafts`).
  context: Int[Array, "s w"]
  # Grammar-constrained requests (see `guide`): the host commits their tokens.
  constrained: Bool[Array, "s"]
  cursor: Int[Array, "s"]  # first undecided column: where `allowed` applies
  allowed: jax.Array  # [s, ceil(vocab / 32)] uint32 token bitmask at the cursor
  proposal: Int[Array, "s b"]  # the last guided pass's proposals for the current block
  picked: Bool[Array, "s b"]  # of which the refinement rule would commit these
  proposed: Bool[Array, "s"]  # whether that pass refined the row
  # Log-probabilities (written by `logprobs` passes): each committed token's
  # under the pass that committed it, and that distribution's top tokens.
  logp: Float[Array, "s g"]
  top_ids: Int[Array, "s g k"]
  top_logp: Float[Array, "s g k"]


TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's bound)


@dataclasses.dataclass(frozen=True)
class SlotConfig:
  """Static shapes: compiled once per engine."""
  num_slots: int
  block_size: int
  max_prompt: int  # prompt tokens a slot can hold (BOS included)
  max_new_tokens: int  # a multiple of block_size
  mask_id: int
  eos_id: int
  vocab_size: int = 0  # the model's logits (sizes the grammar bitmasks)
  # Tokens a slot's KV cache holds for one request: prompt, suffix and the
  # generation rounded up to blocks (0: max_prompt + max_new_tokens). Every
  # slot reserves this much, so it is what the engine's memory is made of.
  max_context: int = 0
  # Ids besides [MASK] that no pass proposes (`tokenizer.never_generated`).
  read_only_ids: tuple[int, ...] = ()
  # The most prompt tokens (its end) that revising rows copy drafts from.
  max_lookup_context: int = 4096
  # Columns of a revising row's verified head (0: the block size): the base's
  # next token and the drafts after it. Copied and table drafts run past the
  # model's block, so a wider head keeps more a pass (`ThresholdSampler.head_width`).
  head_width: int = 0
  # The widths a pass of heads alone may take, increasing, the last the
  # head's; each such pass takes the smallest that holds every revising row's
  # drafts (`Transformer.forward_speculative`). (): always the head's width.
  pass_widths: tuple[int, ...] = ()

  def __post_init__(self):
    if self.head_width and self.head_width < self.block_size:
      raise ValueError(f"head_width must be 0 or at least the block size {self.block_size}, got {self.head_width}")
    if self.pass_widths:
      check_pass_widths(tuple(self.pass_widths), self.head)

  @property
  def head(self) -> int:
    """A revising row's head columns."""
    return self.head_width or self.block_size

  @property
  def never_proposed(self) -> tuple[int, ...]:
    return tuple(sorted({self.mask_id, *self.read_only_ids}))

  @property
  def context(self) -> int:
    return self.max_context or self.max_prompt + self.max_new_tokens

  @property
  def lookup_window(self) -> int:
    return min(self.max_prompt, self.max_lookup_context)

  @property
  def bitmask_words(self) -> int:
    return grammar.bitmask_words(self.vocab_size)

  @property
  def cache_len(self) -> int:
    # The last step writes [finished block | current block] past the region's end.
    return self.context + self.block_size


def init_slots(spec: ModelSpec, sc: SlotConfig) -> Slots:
  s, g, bs = sc.num_slots, sc.max_new_tokens, sc.block_size
  zeros = lambda: jnp.zeros((s,), jnp.int32)  # noqa: E731  (distinct buffers: the state is donated)
  flags = lambda: jnp.zeros((s,), bool)  # noqa: E731
  return Slots(cache=KVCache.init(spec.cfg, s, sc.cache_len, per_row=True),
               gen=jnp.full((s, g), sc.mask_id, jnp.int32), prompt_len=zeros(), block=zeros(), step=zeros(),
               head=flags(), active=flags(), n_blocks=zeros(), max_tokens=zeros(),
               decoding=rule.Decoding.broadcast(s, threshold=1.0, min_tokens=1),
               key=jnp.zeros((s, 2), jnp.uint32), passes=zeros(), filled=zeros(),
               ahead=jnp.zeros((s, sc.head), jnp.int32), n_ahead=zeros(),
               context=jnp.full((s, sc.lookup_window), -1, jnp.int32), constrained=flags(), cursor=zeros(),
               allowed=jnp.zeros((s, grammar.bitmask_words(spec.cfg.vocab_size)), jnp.uint32),
               proposal=jnp.zeros((s, bs), jnp.int32), picked=jnp.zeros((s, bs), bool), proposed=flags(),
               logp=jnp.zeros((s, g), jnp.float32), top_ids=jnp.zeros((s, g, TOP_LOGPROBS), jnp.int32),
               top_logp=jnp.zeros((s, g, TOP_LOGPROBS), jnp.float32))


def admit(spec: ModelSpec, sc: SlotConfig, params, slots: Slots, rows: Int[Array, "k"], fixed: Int[Array, "k p"],
          positions: Int[Array, "k p"], n_fixed: Int[Array, "k"], gen_position: Int[Array, "k"],
          max_tokens: Int[Array, "k"], decoding: rule.Decoding, key_data: jax.Array,
          last: Bool[Array, "k"] | None = None, first: Bool[Array, "k"] | None = None, table=None,
          resume: bool = False) -> Slots:
  """Resets slots `rows` and encodes each `fixed[i, :n_fixed[i]]` (the prompt,
  after the suffix when infilling) at `positions[i]` into its cache row, all
  in one forward: on a CPU a prefill's fixed cost outweighs its tokens' until
  a few hundred tokens, so k short prompts cost little more than one. Row i's
  generation region starts at RoPE position `gen_position[i]`, and it may keep
  `max_tokens[i]` tokens (blocks decode whole blocks of them); `decoding`
  and `key_data` hold the requests' settings and keys (k rows). A row equal
  to num_slots is padding: its results are dropped. A constrained request's
  first `guide` follows.

  Chunked prefill: a long prompt arrives as consecutive pieces, one call
  each. With `resume` (static) the pieces are appended to what the rows'
  caches already hold (each reads the earlier pieces and itself); a row
  starts decoding only after its `last` piece (until then passes leave it
  alone). By default every row is a whole prompt.

  `first` marks revising rows whose passes carry heads alone (copies and
  the table draft, `model_drafts` off): after their last piece the base's
  first token is proposed from the prompt's last state here, and their first
  head carries it with copied and `table` drafts, as the one-shot generator's
  first head does. Other revising rows start from an empty head."""
  model = bind(spec, params)
  c = slots.cache
  k, p = fixed.shape
  last = jnp.ones((k,), bool) if last is None else last
  put = lambda x, v, axis=0: (x.at[:, rows] if axis else x.at[rows]).set(  # noqa: E731
      jnp.broadcast_to(jnp.asarray(v, x.dtype), (x.shape[0], k, *x.shape[2:]) if axis else (k, *x.shape[1:])),
      mode="drop")
  valid_new = jnp.arange(p)[None] < n_fixed[:, None]
  t = jnp.zeros((k,), jnp.float32) if spec.cfg.time_conditioning else None
  if resume:
    # A resumed row reads its earlier chunks: it starts from its whole cache row.
    row_of = lambda x, axis=0: jnp.take(x, rows, axis=axis, mode="fill", fill_value=0)  # noqa: E731
    base = KVCache(k=row_of(c.k, 1), v=row_of(c.v, 1), valid=row_of(c.valid), length=row_of(c.length),
                   last_hidden=row_of(c.last_hidden))
    _, new = model.forward_cached(fixed, positions, base, commit=True, valid_new=valid_new, t=t, commit_len=n_fixed,
                                  clean=True)
    cache = c.replace(k=put(c.k, new.k, 1), v=put(c.v, new.v, 1), valid=put(c.valid, new.valid),
                      length=put(c.length, new.length), last_hidden=put(c.last_hidden, new.last_hidden))
  else:
    # A new row reads nothing before its prompt: it is encoded into a cache of
    # the prompt's p slots, and only those slots of the row are written. The
    # rest keeps the last request's keys, past the fill point and not valid,
    # so admitting costs the prompt, not the context (a 128K-slot row is GBs).
    n, _, g, d, _ = c.k.shape
    base = KVCache(k=jnp.zeros((n, k, g, d, p), c.k.dtype), v=jnp.zeros((n, k, g, p, d), c.v.dtype),
                   valid=jnp.zeros((k, p), bool), length=jnp.zeros((k,), jnp.int32),
                   last_hidden=jnp.zeros((k, c.last_hidden.shape[1]), c.last_hidden.dtype))
    _, new = model.forward_cached(fixed, positions, base, commit=True, valid_new=valid_new, t=t, commit_len=n_fixed,
                                  clean=True)
    valid_row = jnp.zeros((k, c.max_len), bool).at[:, :p].set(new.valid)
    cache = c.replace(k=c.k.at[:, rows, :, :, :p].set(new.k.astype(c.k.dtype), mode="drop"),
                      v=c.v.at[:, rows, :, :p, :].set(new.v.astype(c.v.dtype), mode="drop"),
                      valid=put(c.valid, valid_row), length=put(c.length, new.length),
                      last_hidden=put(c.last_hidden, new.last_hidden))
  passes = jnp.take(slots.passes, rows, mode="fill", fill_value=0) + 1 if resume else 1
  w = sc.lookup_window
  before = (jnp.take(slots.context, rows, axis=0, mode="fill", fill_value=-1) if resume
            else jnp.full((k, w), -1, jnp.int32))
  appended = jnp.concatenate([before, jnp.where(valid_new, fixed, -1)], 1)
  context = jax.vmap(lambda row, n: lax.dynamic_slice_in_dim(row, n, w))(appended, n_fixed)
  admitted = slots.replace(
      context=put(slots.context, context),
      cache=cache, gen=put(slots.gen, sc.mask_id), prompt_len=put(slots.prompt_len, gen_position),
      # A revising row always carries a head (its first, empty): it rides every pass that has them.
      block=put(slots.block, 0), step=put(slots.step, 0), head=put(slots.head, decoding.revise),
      filled=put(slots.filled, 0), n_ahead=put(slots.n_ahead, -1),
      active=put(slots.active, last), n_blocks=put(slots.n_blocks, -(-max_tokens // sc.block_size)),
      max_tokens=put(slots.max_tokens, max_tokens),
      decoding=jax.tree.map(put, slots.decoding, decoding), key=put(slots.key, key_data),
      passes=put(slots.passes, passes), constrained=put(slots.constrained, False), cursor=put(slots.cursor, 0),
      proposed=put(slots.proposed, False))
  if first is None or not spec.cfg.shift_logits:
    return admitted
  return _first_heads(sc, model, admitted, rows, first & last, new.last_hidden, decoding, key_data, table)


def _first_heads(sc: SlotConfig, model, s: Slots, rows, first, last_hidden, decoding: rule.Decoding, key_data,
                 table) -> Slots:
  """Slots `rows` marked `first` start from the base's first token (the
  request's proposal from the prompt's last state, with its logit moves and
  its first column's noise) and copied and table drafts after it."""
  k = rows.shape[0]

  def proposed():
    logits = model.logits(last_hidden[:, None].astype(compute_dtype(model.cfg.dtype)))  # as a pass reads it
    moves = rule.penalty(jnp.zeros((k, logits.shape[-1]), jnp.float32), decoding.presence_penalty,
                         decoding.frequency_penalty, decoding.bias_ids, decoding.bias)
    x0, _ = rule.propose(logits.astype(jnp.float32) + moves[:, None, :], rule.pass_keys(key_data, 0, 0),
                         jnp.zeros((k, 1), jnp.int32), sc.never_proposed, decoding.temperature, decoding.top_p)
    return x0[:, 0]

  def started():
    mark = jnp.zeros(s.n_ahead.shape, bool).at[rows].set(first, mode="drop")
    ahead = s.ahead.at[rows, 0].set(proposed(), mode="drop")
    n_ahead = jnp.where(mark, 0, s.n_ahead)
    zero = jnp.zeros_like(s.n_ahead)
    v = _with_lookup(sc, s, rule.Verified(keep=zero, ended=zero > 0, ahead=ahead, n_ahead=n_ahead), s.filled, table)
    return jnp.where(mark[:, None], v.ahead, s.ahead), jnp.where(mark, v.n_ahead, s.n_ahead)

  ahead, n_ahead = lax.cond(jnp.any(first), started, lambda: (s.ahead, s.n_ahead))
  return s.replace(ahead=ahead, n_ahead=n_ahead)


def cancel(slots: Slots, row) -> Slots:
  return slots.replace(active=slots.active.at[row].set(False))


def step(spec: ModelSpec, sc: SlotConfig, params, s: Slots, with_head: bool = True, guided: bool = False,
         logprobs: bool = False, revising: bool = False, table=None, head_only: bool = False) -> Slots:
  """One refinement pass over every slot (idle slots ride along, committing nothing).

  with_head=True: each slot sends [its finished block, if any | its current
  block], and the finished blocks go into the cache. with_head=False: a pass
  half as long, current blocks only; slots whose finished block still waits
  for the cache sit this pass out unchanged. A block's second and later passes
  need no head, so the engine alternates the two and no pass carries a
  finished-block's worth of dead tokens for every slot.

  `revising` (static; an adapted AR model, with_head): revising rows send
  [their next token and drafts | a masked block after them] instead, and keep
  what the base's causal pass verifies (`rule.verify`); the others decode
  their blocks as above in the same pass. `table` (a `DraftTable` or None):
  revising rows with `lookup` also draft from it. `head_only` (static, with
  `revising`; every busy row revises, none asks for log-probabilities): the
  pass carries the heads alone, no masked block, so the next drafts come from
  copies and the table only (`ThresholdSampler.model_drafts`)."""
  model = bind(spec, params)
  bs = sc.block_size
  lo = s.block * bs
  lane = jnp.arange(bs, dtype=jnp.int32)[None]
  take = jax.vmap(lambda row, start: lax.dynamic_slice_in_dim(row, start, bs))
  tail = take(s.gen, jnp.minimum(lo, sc.max_new_tokens - bs))
  tail_pos = (s.prompt_len + lo)[:, None] + lane
  t = jnp.mean(tail == sc.mask_id, axis=-1).astype(jnp.float32) if spec.cfg.time_conditioning else None
  d = s.decoding
  columns = lo[:, None] + lane
  keys = rule.pass_keys(s.key, s.block, s.step)
  rev = s.decoding.revise & s.active
  block_rows = s.active & ~s.decoding.revise  # revising rows move only in revising passes
  if head_only and (not revising or guided or logprobs):
    raise ValueError("a pass of heads alone is a revising pass without guided rows or log-probabilities")
  hw = sc.head
  if revising:
    if not with_head:
      raise ValueError("revising rows need passes with heads")
    moving = block_rows
    head_valid = s.head & moving
    at = (s.prompt_len + s.filled)[:, None]
    r = rev[:, None]
    head_lane = jnp.arange(hw, dtype=jnp.int32)[None]
    col = s.filled[:, None] + head_lane
    if head_only:
      # The heads alone: their logits and, after them, the base's next token. A
      # row that does not revise is idle here (the engine's plan): its first
      # column stays valid so that no query reads nothing.
      valid = jnp.where(r, head_lane <= s.n_ahead[:, None], head_lane == 0)
      if sc.pass_widths:  # the narrowest pass that holds every revising row's drafts
        need = 1 + jnp.max(jnp.where(rev, s.n_ahead, 0))
        logits, pending = model.forward_speculative(s.ahead, at + head_lane, s.cache, valid, sc.pass_widths, need)
      else:
        logits, pending = model.forward_speculative(s.ahead, at + head_lane, s.cache, valid)
      columns = jnp.concatenate([col, col[:, :1] + s.n_ahead[:, None] + 1], 1)
    else:
      # A row decoding blocks sends its finished block in the head's first
      # columns (the rest not valid: never read, never kept), then its block.
      wide = lambda x: jnp.pad(x, ((0, 0), (0, hw - bs)), mode="edge")  # noqa: E731
      tokens = jnp.where(r, jnp.concatenate([s.ahead, jnp.full_like(tail, sc.mask_id)], 1),
                         jnp.concatenate([wide(take(s.gen, jnp.maximum(lo - bs, 0))), tail], 1))
      positions = jnp.where(r, jnp.concatenate([at + head_lane, at + s.n_ahead[:, None] + 1 + lane], 1),
                            jnp.concatenate([wide(jnp.maximum(tail_pos - bs, 0)), tail_pos], 1))
      logits, pending = model.forward_speculative(tokens, positions, s.cache,
                                                  jnp.where(r, head_lane <= s.n_ahead[:, None],
                                                            head_valid[:, None] & (head_lane < bs)))
      columns = jnp.where(r, jnp.concatenate([col, col[:, :bs] + s.n_ahead[:, None] + 1], 1),
                          jnp.concatenate([wide(columns - bs), columns], 1))
    keys = rule.pass_keys(s.key, jnp.where(rev, 0, s.block), jnp.where(rev, 0, s.step))  # one draw a column
    cache = None
  elif with_head:
    moving = block_rows
    prev = take(s.gen, jnp.maximum(lo - bs, 0))
    head_valid = s.head & moving
    tokens = jnp.concatenate([prev, tail], axis=1)
    positions = jnp.concatenate([jnp.maximum(tail_pos - bs, 0), tail_pos], axis=1)
    # An idle row still sees its own tail: no query ever has nothing to attend to.
    valid_new = jnp.concatenate([jnp.broadcast_to(head_valid[:, None], prev.shape), jnp.ones_like(tail, bool)], 1)
    logits, cache = model.forward_cached(tokens, positions, s.cache, commit=True, valid_new=valid_new, t=t,
                                         commit_len=jnp.where(head_valid, bs, 0), new_block=bs)
  else:
    moving = block_rows & ~s.head
    # Committing 0 tokens: the tail's keys are written past each fill point,
    # where nothing reads them, into the donated cache in place. (commit=False
    # hands back the input cache, so the write would need a copy of all of it.)
    logits, cache = model.forward_cached(tail, tail_pos, s.cache, commit=True, t=t,
                                         commit_len=jnp.zeros_like(s.prompt_len))
  logits = _move_logits(sc, s, logits)
  if guided:
    logits = jnp.concatenate([logits[:, :-bs], _allow_at_cursor(logits[:, -bs:], s, lo)], 1)
  if revising:
    # Only the tail's confidence is read (its drafts' offers, the block rows'
    # picks): the head's columns skip the vocabulary's normaliser. A pass of
    # heads alone reads none (no drafts after the base's token, no block rows).
    x0 = rule.choose(logits, keys, columns, sc.never_proposed, d.temperature, d.top_p)
    conf = jnp.full(x0[:, hw:].shape, -1.0) if head_only else \
        rule.confidence(logits[:, hw:], x0[:, hw:], sc.never_proposed)
  else:
    x0, conf = rule.propose(logits, keys, columns, sc.never_proposed, d.temperature, d.top_p)
  top = top_logprobs_of(logits, sc.never_proposed) if logprobs else None
  if revising:  # the blocks' proposals are the tail's; the revising rows' verifications, the head's
    kept_logp = None
    if logprobs:  # of the head's own tokens (a draw's is its proposal's only where nothing moved the logits)
      lsm = jax.nn.log_softmax(rule.exclude(logits[:, :hw], sc.never_proposed), axis=-1)
      kept_logp = jnp.take_along_axis(lsm, s.ahead[..., None], axis=-1)[..., 0]
    odds = rule.odds_where_asked(logits, s.ahead, sc.never_proposed, d.agreement)
    verifying = (x0[:, :hw], odds, kept_logp, None if top is None else tuple(x[:, :hw] for x in top))
    x0 = x0[:, hw:]
    if head_only:  # the base's next token and no drafts after it (conf -1: never offered)
      x0 = jnp.concatenate([x0, jnp.full((x0.shape[0], bs - 1), sc.mask_id, x0.dtype)], 1)
      conf = jnp.concatenate([conf, jnp.full((conf.shape[0], bs - 1), -1.0, conf.dtype)], 1)
    top = None if top is None else tuple(x[:, hw:] for x in top)
  candidates = (tail == sc.mask_id) & moving[:, None]
  picked = rule.picks(d, conf, candidates, s.step)
  commit = picked & ~s.constrained[:, None] if guided else picked
  new_tail = jnp.where(commit, x0, tail)
  if cache is not None:
    s = s.replace(cache=cache)
  if logprobs:
    # A constrained row's proposals are recorded too: the host commits a
    # prefix of them, and what it leaves is proposed again and overwritten.
    record = commit | (candidates & s.constrained[:, None]) if guided else commit
    s = _record_logprobs(sc, s, record, jnp.log(jnp.maximum(conf, 1e-30)), *top)
  if guided:
    guided_rows = s.constrained & moving
    s = s.replace(proposal=jnp.where(guided_rows[:, None], x0, s.proposal),
                  picked=jnp.where(guided_rows[:, None], picked, s.picked), proposed=guided_rows)
  s = _write_block(sc, s, moving, new_tail).replace(passes=s.passes + moving.astype(jnp.int32))
  if revising:
    s = _revise(sc, s, rev, pending, head_valid, x0, conf, *verifying, logprobs, table)
  return s


def _revise(sc: SlotConfig, s: Slots, rev, pending, head_valid, tail_x0, tail_conf, base_x0, odds, kept_logp,
            base_top, logprobs: bool, table=None) -> Slots:
  """A revising pass's results: the verified head tokens of `rev` rows are
  kept (the cache of every row is committed here: the block rows' finished
  blocks too), and the next head is the base's token and the tail's drafts."""
  bs, hw = sc.block_size, sc.head
  lane = jnp.arange(hw, dtype=jnp.int32)[None]
  v = rule.verify(s.ahead, s.n_ahead, base_x0, tail_x0, tail_conf, s.decoding.threshold, sc.eos_id,
                  jnp.where(rev, s.max_tokens - s.filled, 0), odds, s.decoding.agreement)
  v = v.replace(ahead=jnp.pad(v.ahead, ((0, 0), (0, hw - v.ahead.shape[1]))))  # the next head: hw columns
  rows = jnp.arange(s.gen.shape[0])[:, None]
  cols = s.filled[:, None] + lane
  kept = rev[:, None] & (lane < v.keep[:, None])

  def put(dst, new):
    mask = kept.reshape(kept.shape + (1,) * (new.ndim - 2))
    old = dst[rows, jnp.minimum(cols, dst.shape[1] - 1)]
    return dst.at[rows, cols].set(jnp.where(mask, new.astype(dst.dtype), old), mode="drop")

  out = s.replace(cache=pending.commit(jnp.where(rev, v.keep, jnp.where(head_valid, bs, 0))), gen=put(s.gen, s.ahead))
  if logprobs:  # the kept tokens' log-probabilities under the base, from the pass that verified them
    out = out.replace(logp=put(s.logp, kept_logp), top_logp=put(s.top_logp, base_top[0]),
                      top_ids=put(s.top_ids, base_top[1]))
  filled = s.filled + jnp.where(rev, v.keep, 0)
  v = _with_lookup(sc, s.replace(gen=out.gen), v, filled, table)
  ended = rev & (v.ended | (filled >= s.max_tokens))
  r = rev[:, None]
  return out.replace(filled=filled, ahead=jnp.where(r, v.ahead, s.ahead), n_ahead=jnp.where(rev, v.n_ahead, s.n_ahead),
                     active=out.active & ~ended, head=out.head & ~ended, passes=out.passes + rev.astype(jnp.int32))


def _with_lookup(sc: SlotConfig, s: Slots, v: rule.Verified, filled, table=None) -> rule.Verified:
  """Each row's next head with drafts copied from its prompt and text where
  they outnumber the model's own (`rule.lookup_drafts`), its free columns
  then filled from `table` (`DraftTable.extend`); rows whose
  `decoding.lookup` is 0 keep theirs. Skipped when no row asks."""
  def look():
    w = sc.lookup_window
    rows = jnp.arange(s.gen.shape[0])
    gen = s.gen.at[rows, filled].set(v.ahead[:, 0], mode="drop")  # the base's next token ends the text
    text = jnp.concatenate([s.context, gen], 1)
    col = jnp.arange(s.gen.shape[1])[None]
    known = jnp.concatenate([s.context >= 0, col <= filled[:, None]], 1)
    end = jnp.minimum(w + filled, text.shape[1] - 1)
    out = rule.with_lookup(v, *rule.lookup_drafts(text, known, end, s.decoding.lookup, sc.head - 1))
    if table is not None:  # then the model's table of its own answers goes on from them
      ahead, n_ahead = table.extend(*draft_table.context_before(table, text, known, end), out.ahead, out.n_ahead,
                                    s.decoding.table_floor)
      use = s.decoding.lookup > 0
      out = out.replace(ahead=jnp.where(use[:, None], ahead, out.ahead), n_ahead=jnp.where(use, n_ahead, out.n_ahead))
    return out
  return lax.cond(jnp.any((s.decoding.lookup > 0) & s.decoding.revise & s.active), look, lambda: v)


def _move_logits(sc: SlotConfig, s: Slots, logits):
  """Each row's logit_bias and penalties (`rule.penalize`), counting the tokens
  its generation region holds; skipped when no row asks for any."""
  d = s.decoding
  asks = (d.presence_penalty != 0) | (d.frequency_penalty != 0) | jnp.any(d.bias_ids != rule.NO_BIAS_ID, axis=-1)

  def moves():
    counts = rule.token_counts(s.gen, s.gen != sc.mask_id, logits.shape[-1])
    return rule.penalty(counts, d.presence_penalty, d.frequency_penalty, d.bias_ids, d.bias)

  # Only the [s, v] move is chosen by the branch: the [s, t, v] logits are
  # not copied out of it, and the sum fuses into what reads them next.
  b, _, v = logits.shape
  delta = lax.cond(jnp.any(asks & s.active), moves, lambda: jnp.zeros((b, v), jnp.float32))
  return logits.astype(jnp.float32) + delta[:, None, :]


def top_logprobs_of(logits, never: tuple[int, ...]):
  """(log-probs [b, t, K], ids [b, t, K]) of each position's most likely
  tokens, those never proposed excluded."""
  if isinstance(logits, kernels.HeadInput):
    logits = logits.logits()
  lsm = jax.nn.log_softmax(logits.astype(jnp.float32).at[..., list(never)].set(-jnp.inf), axis=-1)
  vals, ids = lax.top_k(lsm, TOP_LOGPROBS)
  return vals, ids.astype(jnp.int32)


def _record_logprobs(sc: SlotConfig, s: Slots, where, logp, top_vals, top_ids) -> Slots:
  """The current block's `where` positions take these log-probabilities."""
  bs = sc.block_size
  lo = jnp.minimum(s.block * bs, sc.max_new_tokens - bs)

  def put(dst, new):
    old = jax.vmap(lambda row, start: lax.dynamic_slice_in_dim(row, start, bs))(dst, lo)
    mask = where.reshape(where.shape + (1,) * (new.ndim - 2))
    blk = jnp.where(mask, new.astype(dst.dtype), old)
    return jax.vmap(lambda row, b, start: lax.dynamic_update_slice_in_dim(row, b, start, 0))(dst, blk, lo)

  return s.replace(logp=put(s.logp, logp), top_ids=put(s.top_ids, top_ids), top_logp=put(s.top_logp, top_vals))


def _allow_at_cursor(logits, s: Slots, lo):
  """The block's logits with each constrained row's cursor column masked to
  its grammar's bitmask. One proposal then draws every column, the cursor's
  under the grammar with its own noise (a column's draw reads only its
  logits), and the top log-probs there are the allowed tokens'."""
  if isinstance(logits, kernels.HeadInput):
    logits = logits.logits()
  bs = logits.shape[1]
  here = s.constrained[:, None] & (jnp.arange(bs)[None] == jnp.clip(s.cursor - lo, 0, bs - 1)[:, None])
  return jnp.where(here[..., None], rule.allow(logits.astype(jnp.float32), s.allowed[:, None]), logits)


def _write_block(sc: SlotConfig, s: Slots, moving, new_tail) -> Slots:
  """The current block of `moving` rows becomes `new_tail`; a row whose block
  is then full moves on to the next (its finished block waits for the cache:
  `head`) or ends (EOS in it, or its last block)."""
  bs = sc.block_size
  lo = s.block * bs
  put = jax.vmap(lambda row, blk, start: lax.dynamic_update_slice_in_dim(row, blk, start, 0))
  gen = jnp.where(moving[:, None], put(s.gen, new_tail, jnp.minimum(lo, sc.max_new_tokens - bs)), s.gen)
  finished = moving & ~jnp.any(new_tail == sc.mask_id, axis=-1)
  done = finished & (jnp.any(new_tail == sc.eos_id, axis=-1) | (s.block + 1 >= s.n_blocks))
  return s.replace(gen=gen, block=jnp.where(finished, s.block + 1, s.block),
                   step=jnp.where(finished, 0, jnp.where(moving, s.step + 1, s.step)),
                   head=jnp.where(moving, finished & ~done, s.head & s.active), active=s.active & ~done)


def guide(sc: SlotConfig, s: Slots, rows: Bool[Array, "s"], tokens: Int[Array, "s b"], take: Bool[Array, "s b"],
          cursor: Int[Array, "s"], allowed, forced: Bool[Array, "s b"], logprobs: bool = True) -> Slots:
  """The host's commits for constrained `rows` (which become constrained):
  `tokens` where `take` in the current block (a prefix from the cursor the
  grammar accepted), then the new `cursor` and its bitmask `allowed`
  [s, words]. A row whose block fills moves on as after a pass; `take` all
  False only sets the bitmask. `forced` positions hold tokens the grammar
  forced (no pass proposed them): certain, log-probability 0 (recorded with
  `logprobs`, static: no busy request asked for them, none is read)."""
  bs = sc.block_size
  lo = jnp.minimum(s.block * bs, sc.max_new_tokens - bs)
  if logprobs:
    k = jnp.arange(TOP_LOGPROBS)
    s = _record_logprobs(sc, s, forced & rows[:, None], jnp.zeros(forced.shape, jnp.float32),
                         jnp.where(k == 0, 0.0, -jnp.inf) + jnp.zeros(forced.shape + (1,)),
                         jnp.where(k == 0, tokens[..., None], 0))
  tail = jax.vmap(lambda row, start: lax.dynamic_slice_in_dim(row, start, bs))(s.gen, lo)
  writes = rows & s.active & jnp.any(take, axis=-1)
  out = _write_block(sc, s, writes, jnp.where(take, tokens, tail))
  # Writing is not a refinement pass: the block's pass count stays.
  out = out.replace(step=jnp.where(writes & (out.block == s.block), s.step, out.step))
  return out.replace(constrained=s.constrained | rows, cursor=jnp.where(rows, cursor, s.cursor),
                     allowed=jnp.where(rows[:, None], jnp.asarray(allowed, jnp.uint32), s.allowed),
                     proposed=s.proposed & ~rows)


def _map_rows(fn, s: Slots, *others: Slots) -> Slots:
  """fn(array, slot_axis, *matching arrays of `others`) over every slot-indexed
  array of the state but the cache's keys and values, which stay whole (a
  cache of fewer rows than its buffers reads and writes their first rows)."""
  def one(get, axis):
    return fn(get(s), axis, *(get(o) for o in others))

  cache = s.cache.replace(**{name: one(lambda x, name=name: getattr(x.cache, name), 0)
                             for name in ("valid", "length", "last_hidden")})
  rest = {f.name: jax.tree.map(lambda x, *o: fn(x, 0, *o), getattr(s, f.name), *(getattr(o, f.name) for o in others))
          for f in dataclasses.fields(s) if f.name != "cache"}
  return s.replace(cache=cache, **rest)


def step_first(spec: ModelSpec, sc: SlotConfig, rows: int, params, s: Slots, with_head: bool = True,
               guided: bool = False, logprobs: bool = False, revising: bool = False, table=None,
               head_only: bool = False) -> Slots:
  """`step` over slots [0, rows) only: requests take the lowest free slots, so
  a lightly loaded engine runs passes as small as its load."""
  if rows == sc.num_slots:
    return step(spec, sc, params, s, with_head, guided, logprobs, revising, table, head_only)
  head = step(spec, sc, params, _map_rows(lambda x, axis: lax.slice_in_dim(x, 0, rows, axis=axis), s), with_head,
              guided, logprobs, revising, table, head_only)
  out = _map_rows(lambda x, axis, new: lax.dynamic_update_slice_in_dim(x, new, 0, axis), s, head)
  # The pass read and wrote its rows' keys and values in the whole buffers, in
  # place: no copy of the rows in, none back (at a long context, copying them
  # cost a pass many times its own work).
  return out.replace(cache=out.cache.replace(k=head.cache.k, v=head.cache.v))


def published(s: Slots) -> jax.Array:
  """What a publish reads of the state, one int32 row a slot: the host reads
  it in one transfer (nine arrays cost nine), `unpack_published` splits it."""
  per_slot = (s.block, s.active, s.passes, s.head, s.decoding.revise, s.filled, s.n_ahead)
  return jnp.concatenate([s.gen.astype(jnp.int32), jnp.stack(per_slot, 1).astype(jnp.int32),
                          s.ahead.astype(jnp.int32)], 1)


def unpack_published(rows: np.ndarray, sc: SlotConfig) -> tuple[np.ndarray, ...]:
  """A host copy of `published`'s array as `publishing.Snapshot.of_slots`'s
  arguments, in order (views of it; the flags as bools)."""
  g = sc.max_new_tokens
  block, active, passes, head, revise, filled, n_ahead = (rows[:, g + i] for i in range(7))
  gen, ahead = rows[:, :g], rows[:, g + 7:]
  return gen, block, active.astype(bool), passes, head.astype(bool), revise.astype(bool), filled, ahead, n_ahead


class Programs(NamedTuple):
  """A model's jitted admit, pass and release over the packed slot state
  (`packing`), and its weights as the flat list of leaves they take
  (`compile_programs`)."""
  model: Any
  leaves: list
  packing: packing_lib.Packing
  admit: Callable
  step: Callable
  release: Callable


def state_packing(spec: ModelSpec, sc: SlotConfig) -> packing_lib.Packing:
  """How the engine holds `Slots` between programs: the cache's keys and
  values whole, the rest packed (`packing`)."""
  shapes = jax.eval_shape(lambda: init_slots(spec, sc))
  return packing_lib.Packing.of(shapes, sc.num_slots, keep_whole=lambda name: name in ("cache.k", "cache.v"))


def compile_programs(loaded, sc: SlotConfig) -> Programs:
  """(admit, pass, release) jitted over the packed slot state (`state_packing`),
  donated so it is updated in place. pass(leaves, state, guides, table, rows=k,
  with_head=h, logprobs=l, revising=r, passes=p, head_only=o) compiles once per
  (k, h, l, r, p, o) and whether `guides` and `table` are None; it runs up to `passes` passes
  in one launch, ending after the first pass in which a row ended. Given
  `guides` (the operands of `guide`), the host's commits for the constrained
  rows land first, in the same program, and the pass runs guided; `table` (a `DraftTable`) drafts for revising rows with
  `lookup`. It returns the new state, `published(state)`, after a guided pass
  the rows' (proposal, picked, proposed) and after a logprobs pass their
  (logp, top_ids, top_logp) (else None), all buffers of their own: the host
  can read a pass's results after handing its state to the next pass.
  release(state, mask) ends the requests of the rows `mask` marks.

  Both take the weights as `Programs.leaves`, a flat list of distinct
  arrays: jit's dispatch flattens a nested dict of an imported model's
  thousand-odd arrays in about half a millisecond, every pass, and checks
  each argument it is handed (a stacked decoding copy, `model.stacked`,
  names each stack once a layer: handed once, it is one argument)."""
  spec = loaded.spec
  every, tree = jax.tree.flatten(loaded.params)
  slot = {}
  index = [slot.setdefault(id(x), len(slot)) for x in every]
  leaves = list({id(x): x for x in every}.values())
  packing = state_packing(spec, sc)

  def params_of(leaves):
    return jax.tree.unflatten(tree, [leaves[i] for i in index])

  def admit_flat(leaves, state, *args, **kwargs):
    return packing.pack(admit(spec, sc, params_of(leaves), packing.unpack(state), *args, **kwargs))

  def run(leaves, state, guides, table, rows, with_head=True, logprobs=False, revising=False, passes=1,
          head_only=False):
    params = params_of(leaves)
    state = packing.unpack(state)
    if guides is not None:
      state = guide(sc, state, *guides, logprobs=logprobs)
    one = functools.partial(step_first, spec, sc, rows, params, with_head=with_head, guided=guides is not None,
                            logprobs=logprobs, revising=revising, table=table, head_only=head_only)
    state = one(state)
    if passes > 1:  # more passes until one of the rows ends (its slot is then free for the host to refill)
      decoding = jnp.sum(state.active[:rows])
      go_on = lambda c: (c[0] < passes) & (decoding > 0) & (jnp.sum(c[1].active[:rows]) == decoding)  # noqa: E731
      _, state = lax.while_loop(go_on, lambda c: (c[0] + 1, one(c[1])), (jnp.int32(1), state))
    guided_view = (state.proposal, state.picked, state.proposed) if guides is not None else None
    logprob_view = (state.logp, state.top_ids, state.top_logp) if logprobs else None
    return packing.pack(state), published(state), guided_view, logprob_view

  def release(state, mask):
    # A freed row's fill point goes back to 0: its idle passes then read
    # nothing, and attention's span (`kernels.read_spans`) follows the
    # requests still decoding, not the longest that ever held a slot.
    s = packing.unpack(state)
    s = s.replace(active=s.active & ~mask, cache=s.cache.replace(length=jnp.where(mask, 0, s.cache.length)))
    return packing.pack(s)

  return Programs(loaded, leaves, packing, jax.jit(admit_flat, donate_argnums=(1,), static_argnames=("resume",)),
                  jax.jit(run, donate_argnums=(1,),
                          static_argnames=("rows", "with_head", "logprobs", "revising", "passes", "head_only")),
                  jax.jit(release, donate_argnums=(0,)))
