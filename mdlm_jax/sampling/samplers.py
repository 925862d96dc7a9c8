"""Masked-diffusion samplers: each a frozen dataclass (static under jit) whose
`run` is one fixed-shape `lax.while_loop` over a [B, L] canvas.

The loop body calls `denoise(tokens, t) -> logits [B, L, V]` (float32) and
applies the one refinement rule (`rule.propose`, `rule.commit`) with the
sampler's settings broadcast over the rows. `keys` [B, 2] are one PRNG key per
row: a row's samples depend on its own key alone, never on its batch.

- AncestralSampler: MDLM's ancestral sampler with the p(x0) cache: a step in
  which no token changed leaves the model input unchanged, so the next step
  reuses the cached distribution instead of running the network.
- LowConfidenceSampler: LLaDA; each step commits the k most confident
  proposals, k spread evenly over the steps of a block.
- ThresholdSampler: Fast-dLLM parallel decoding; each step commits every
  proposal with p >= threshold, and always the most confident one.
The two confidence samplers decode semi-autoregressively when `block_size`
> 0: block by block, left to right, stopping rows at EOS.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable

import jax
import jax.experimental
import jax.numpy as jnp

from mdlm_jax import kernels
from mdlm_jax.diffusion import Schedule
from mdlm_jax.sampling import draft_table, rule
from mdlm_jax.sampling.gumbel import argmax

Denoise = Callable[[jax.Array, jax.Array], jax.Array]


def block_bounds(gen_start: int, gen_len: int, block_size: int) -> list[tuple[int, int]]:
  size = block_size if block_size > 0 else gen_len
  return [(gen_start + s, gen_start + min(s + size, gen_len)) for s in range(0, gen_len, size)]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static facts about a canvas the loop needs at trace time."""
  gen_start: int
  gen_len: int
  mask_id: int
  eos_id: int
  # Columns after the generation region that hold a suffix to infill against
  # (0: none). Cached decoding encodes them into the cache with the prompt.
  suffix_len: int = 0
  # Ids besides [MASK] that no position takes: the markers the model reads
  # but never writes (`tokenizer.never_generated`).
  read_only_ids: tuple[int, ...] = ()

  @property
  def never_proposed(self) -> tuple[int, ...]:
    return tuple(sorted({self.mask_id, *self.read_only_ids}))


def _record(drafts, n, tokens, record: bool, emit=None):
  """Keeps the canvas after a step (record) and/or hands it to the host as it
  happens (emit(step, tokens), for streaming drafts)."""
  if emit is not None:
    jax.experimental.io_callback(emit, None, n, tokens, ordered=True)
  if not record:
    return drafts, n + (1 if emit is not None else 0)
  return jax.lax.dynamic_update_index_in_dim(drafts, tokens, n, 0), n + 1


def _eos_in(tokens, lo, hi, eos_id, length):
  """Rows whose columns [lo, hi) contain EOS (lo/hi may be traced)."""
  cols = jnp.arange(length)
  return jnp.any((tokens == eos_id) & (cols >= lo) & (cols < hi), axis=-1)


@dataclasses.dataclass(frozen=True)
class ConfidenceSampler(abc.ABC):
  """What a refinement rule is to every decoder: its settings as one row of
  `rule.Decoding` (`decoding`), applied by `rule.propose` and `rule.picks`
  in the one-shot loops below and, row by row, in the engine's slots. A rule
  is a subclass naming its settings; the engine serves any whose settings
  are all in `rule.Decoding`."""
  block_size: int = 32  # 0: one block spanning the whole generation region
  temperature: float = 0.0
  top_p: float = 1.0
  # Block-causal decoding: a block sees the prompt, the finished blocks and
  # itself, never the masked blocks after it (exact for BD3-LM models). With
  # kv_cache the prompt and each finished block are encoded once, and a step
  # runs the network on the current block only; block_causal alone gives the
  # same result from full-canvas passes (the uncached reference).
  kv_cache: bool = False
  block_causal: bool = False
  # With kv_cache: ask the model for its head inputs and propose with the
  # fused confidence head (a kernel on GPU/TPU when model.attention selects
  # one; the materialised logits, and the same samples, elsewhere).
  fused_head: bool = False
  # OpenAI's logit moves (`rule.penalize`), counting the tokens committed so
  # far in the generation region; logit_bias is ((token id, bias), ...).
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: tuple[tuple[int, float], ...] = ()

  def __post_init__(self):
    if self.block_size < 0:
      raise ValueError(f"block_size must be >= 0, got {self.block_size}")
    object.__setattr__(self, "logit_bias", rule.bias_pairs(self.logit_bias))
    rule.check(**self._rule_fields())

  def check_vocabulary(self, vocab_size: int) -> None:
    """The settings again, logit_bias's ids now checked against the model's vocabulary."""
    rule.check(**self._rule_fields(), vocab_size=vocab_size)

  @abc.abstractmethod
  def _rule_fields(self) -> dict:
    """The rule's settings as `rule.check` and `rule.Decoding.broadcast` take them."""

  def _order_fields(self) -> dict:
    """in_order and the revision settings where the rule has them (`rule.Decoding`)."""
    return {}

  @property
  def revises(self) -> bool:
    return bool(self._order_fields().get("revise", False))

  def decoding(self, rows: int) -> rule.Decoding:
    """The rule's settings for `rows` rows (a request's, in the engine)."""
    return rule.Decoding.broadcast(rows, **self._rule_fields(), **self._order_fields())

  def _picks(self, conf, candidates, step):
    return rule.picks(self.decoding(conf.shape[0]), conf, candidates, step)

  def _move_fields(self) -> dict:
    return {"temperature": self.temperature, "top_p": self.top_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "logit_bias": self.logit_bias}

  @property
  def moves_logits(self) -> bool:
    return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

  def _propose(self, logits, keys, columns, lay: Layout, tokens, valid):
    logits = self._moved(logits, lay, tokens, valid)
    return rule.propose(logits, keys, columns, lay.never_proposed, self.temperature, self.top_p)

  def _moved(self, logits, lay: Layout, tokens, valid):
    """The logits after the request's logit moves (as they were, untouched, without any)."""
    if self.moves_logits:
      logits = logits.logits() if isinstance(logits, kernels.HeadInput) else logits
      v = logits.shape[-1]
      self.check_vocabulary(v)
      cols = jnp.arange(tokens.shape[1])
      counted = valid & (tokens != lay.mask_id) & (cols >= lay.gen_start) & (cols < lay.gen_start + lay.gen_len)
      ids, bias = rule.bias_arrays(self.logit_bias)
      logits = rule.penalize(logits, rule.token_counts(tokens, counted, v), self.presence_penalty,
                             self.frequency_penalty, ids[None], bias[None])
    return logits

  @property
  def is_block_causal(self) -> bool:
    return self.kv_cache or self.block_causal

  def max_iterations(self, lay: Layout) -> int:
    return len(block_bounds(lay.gen_start, lay.gen_len, self.block_size)) * self._steps_cap(lay)

  def run(self, denoise: Denoise, tokens, valid, keys, lay: Layout, record: bool = False, emit=None):
    if self.kv_cache:
      return self._run_cached(denoise, tokens, valid, keys, lay, record, emit)
    bounds = block_bounds(lay.gen_start, lay.gen_len, self.block_size)
    lo_arr = jnp.asarray([b[0] for b in bounds], jnp.int32)
    hi_arr = jnp.asarray([b[1] for b in bounds], jnp.int32)
    n_blocks, steps_cap = len(bounds), self._steps_cap(lay)
    B, L = tokens.shape
    cols = jnp.arange(L)
    max_it = n_blocks * steps_cap
    drafts = jnp.zeros((max_it + 1 if record else 1, B, L), jnp.int32)
    drafts, n_drafts = _record(drafts, 0, tokens, record, emit)

    def cond(s):
      return (s["block"] < n_blocks) & ~jnp.all(s["done"]) & (s["it"] < max_it)

    def body(s):
      tokens = s["tokens"]
      lo, hi = lo_arr[s["block"]], hi_arr[s["block"]]
      masked = (tokens == lay.mask_id) & valid
      frac = jnp.sum(masked, axis=-1) / lay.gen_len
      logits = denoise(tokens, frac.astype(jnp.float32))
      x0, conf = self._propose(logits, rule.pass_keys(keys, s["block"], s["step"]),
                               jnp.maximum(cols - lay.gen_start, 0), lay, tokens, valid)
      in_block = (cols >= lo) & (cols < hi)
      candidates = masked & in_block[None, :] & ~s["done"][:, None]
      commit = self._picks(conf, candidates, s["step"])
      tokens = jnp.where(commit, x0, tokens)
      block_left = jnp.any((tokens == lay.mask_id) & valid & in_block[None, :] & ~s["done"][:, None])
      finished = ~block_left | (s["step"] + 1 >= steps_cap)
      done = s["done"] | (finished & _eos_in(tokens, lo, hi, lay.eos_id, L))
      drafts, n = _record(s["drafts"], s["n_drafts"], tokens, record, emit)
      return {"tokens": tokens, "done": done, "drafts": drafts, "n_drafts": n,
              "block": s["block"] + finished.astype(jnp.int32),
              "step": jnp.where(finished, 0, s["step"] + 1), "it": s["it"] + 1, "nfe": s["nfe"] + 1}

    init = {"tokens": tokens, "done": jnp.zeros((B,), bool), "drafts": drafts,
            "n_drafts": jnp.asarray(n_drafts, jnp.int32), "block": jnp.zeros((), jnp.int32),
            "step": jnp.zeros((), jnp.int32), "it": jnp.zeros((), jnp.int32), "nfe": jnp.zeros((), jnp.int32)}
    out = jax.lax.while_loop(cond, body, init)
    return {"tokens": out["tokens"], "nfe": out["nfe"], "steps": out["it"], "drafts": out["drafts"],
            "num_drafts": out["n_drafts"]}

  def _run_cached(self, model, tokens, valid, keys, lay: Layout, record: bool = False, emit=None):
    """Block-by-block decoding against a KV cache of the prompt and finished
    blocks. `model` provides `cached(tokens, positions, cache, commit, valid_new,
    commit_len, new_block)` -> (logits, cache), `new_cache(batch, max_len)` and
    `positions` [B, L]. The first step of a block also encodes what came
    before it, the finished block or the prompt, into the cache in the same
    pass, so a block costs exactly its steps and the prompt no pass of its own.

    Two nested loops, over blocks and over a block's later steps, rather than
    one loop choosing the pass by a conditional: the later steps only read the
    cache, which the inner loop holds as a constant, and no conditional passes
    the cache through (XLA copies the whole cache there, on every pass)."""
    bs = self.block_size
    if bs <= 0 or lay.gen_len % bs:
      raise ValueError(f"KV-cached decoding needs the generation length ({lay.gen_len}) to be a multiple of"
                       f" block_size ({bs})")
    B, L = tokens.shape
    gs, n_blocks, steps_cap = lay.gen_start, lay.gen_len // bs, self._steps_cap(lay)
    max_it = n_blocks * steps_cap
    positions = model.positions
    ge, sl = gs + lay.gen_len, lay.suffix_len
    # Room for the last pass, which writes [finished block | current block] at the fill point.
    cache = model.new_cache(B, sl + gs + lay.gen_len + bs)
    drafts = jnp.zeros((max_it + 1 if record else 1, B, L), jnp.int32)
    drafts, n_drafts = _record(drafts, 0, tokens, record, emit)
    head = {"head": True} if self.fused_head else {}

    def cond(s):
      return (s["block"] < n_blocks) & ~jnp.all(s["done"]) & (s["it"] < max_it)

    def encode_prompt_and_refine(s, blk, pos):
      # [suffix | prompt | block]: the suffix (infilling) goes first, so the
      # last token kept is the prompt's, whose state a shifted head reads.
      cols = [slice(ge, ge + sl), slice(0, gs)]
      return model.cached(jnp.concatenate([s["tokens"][:, c] for c in cols] + [blk], 1),
                          jnp.concatenate([positions[:, c] for c in cols] + [pos], 1), s["cache"], True,
                          jnp.concatenate([valid[:, c] for c in cols] + [valid[:, gs:gs + bs]], 1), sl + gs, bs,
                          **head)

    def encode_previous_and_refine(s, blk, pos):
      lo = gs + s["block"] * bs
      prev = jax.lax.dynamic_slice_in_dim(s["tokens"], lo - bs, bs, axis=1)
      prev_pos = jax.lax.dynamic_slice_in_dim(positions, lo - bs, bs, axis=1)
      return model.cached(jnp.concatenate([prev, blk], 1), jnp.concatenate([prev_pos, pos], 1), s["cache"], True,
                          None, bs, bs, **head)

    def refine(s, blk, pos):
      return model.cached(blk, pos, s["cache"], False, None, None, 0, **head)

    def advance(s, forward):
      lo = gs + s["block"] * bs
      blk = jax.lax.dynamic_slice_in_dim(s["tokens"], lo, bs, axis=1)
      pos = jax.lax.dynamic_slice_in_dim(positions, lo, bs, axis=1)
      logits, cache = forward(s, blk, pos)
      x0, conf = self._propose(logits, rule.pass_keys(keys, s["block"], s["step"]),
                               s["block"] * bs + jnp.arange(bs), lay, s["tokens"], valid)
      candidates = (blk == lay.mask_id) & ~s["done"][:, None]
      commit = self._picks(conf, candidates, s["step"])
      blk = jnp.where(commit, x0, blk)
      finished = ~jnp.any((blk == lay.mask_id) & ~s["done"][:, None]) | (s["step"] + 1 >= steps_cap)
      tokens = jax.lax.dynamic_update_slice_in_dim(s["tokens"], blk, lo, axis=1)
      done = s["done"] | (finished & jnp.any(blk == lay.eos_id, axis=-1))
      drafts, n = _record(s["drafts"], s["n_drafts"], tokens, record, emit)
      return {"tokens": tokens, "cache": cache, "done": done, "drafts": drafts, "n_drafts": n,
              "block": s["block"] + finished.astype(jnp.int32), "step": jnp.where(finished, 0, s["step"] + 1),
              "it": s["it"] + 1, "nfe": s["nfe"] + 1}

    init = {"tokens": tokens, "cache": cache, "done": jnp.zeros((B,), bool), "drafts": drafts,
            "n_drafts": jnp.asarray(n_drafts, jnp.int32), "block": jnp.zeros((), jnp.int32),
            "step": jnp.zeros((), jnp.int32), "it": jnp.zeros((), jnp.int32), "nfe": jnp.zeros((), jnp.int32)}
    def finish_block(s):
      """The block's steps after its first, while it has masks left."""
      cache = s["cache"]
      rest = {k: v for k, v in s.items() if k != "cache"}
      rest = jax.lax.while_loop(lambda r: (r["step"] > 0) & cond(r),
                                lambda r: {k: v for k, v in advance({**r, "cache": cache}, refine).items()
                                           if k != "cache"}, rest)
      return {**rest, "cache": cache}

    first = finish_block(advance(init, encode_prompt_and_refine))
    out = jax.lax.while_loop(cond, lambda s: finish_block(advance(s, encode_previous_and_refine)), first)
    return {"tokens": out["tokens"], "nfe": out["nfe"], "steps": out["it"], "drafts": out["drafts"],
            "num_drafts": out["n_drafts"]}




def block_causal_mask(valid, lay: Layout, block_size: int) -> kernels.AttentionMask:
  """Column c is visible from row r iff block(c) <= block(r) and c is valid,
  the prompt being block -1 and columns after the generation region unseen.

  Blocks grow left to right, so each row sees a prefix of the columns: a
  structural "prefix" mask (materialise with `.dense(L, L)`)."""
  B, L = valid.shape
  rows = jnp.arange(L, dtype=jnp.int32)
  gen_end = lay.gen_start + lay.gen_len
  bs = max(block_size, 1)
  in_gen = jnp.minimum(lay.gen_start + ((rows - lay.gen_start) // bs + 1) * bs, gen_end)
  q_end = jnp.where(rows < lay.gen_start, lay.gen_start, jnp.where(rows < gen_end, in_gen, L))
  return kernels.AttentionMask(kind="prefix", q_end=jnp.broadcast_to(q_end, (B, L)), kv_valid=valid)


@dataclasses.dataclass(frozen=True)
class LowConfidenceSampler(ConfidenceSampler):
  """LLaDA low-confidence remasking: `steps` refinement steps per block."""
  steps: int = 32

  def _steps_cap(self, lay: Layout) -> int:
    return self.steps

  def __post_init__(self):
    super().__post_init__()
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}")

  def _rule_fields(self) -> dict:
    """The k most confident, k an even split of what is left over the steps
    left, so each block ends after exactly `steps` steps (`rule.floor`)."""
    return {"threshold": rule.NEVER, "min_tokens": 1, "steps": self.steps, **self._move_fields()}


@dataclasses.dataclass(frozen=True)
class ThresholdSampler(ConfidenceSampler):
  """Fast-dLLM: commit every proposal with p >= threshold, and always the
  `min_tokens` most confident ones (Fast-dLLM's rule is min_tokens=1), or
  with `in_order` the `min_tokens` leftmost ones. A floor above 1 bounds the
  passes per block at ceil(block / min_tokens)."""
  threshold: float = 0.9
  min_tokens: int = 1
  in_order: bool = False
  # Revision (an AR model adapted to diffusion only): drafts are kept only
  # while the base's own causal pass proposes them too (`rule.verify`); the
  # text is the base's, and `threshold` says which drafts are worth offering.
  revise: bool = False
  # With revise: below 1, a draft the base did not choose is kept too where
  # the base finds it at least this share as likely as its best token
  # (`rule.verify`): more tokens a pass, text near the base's but not its own.
  agreement: float = 1.0
  # With revise: > 0 offers drafts copied from earlier in the text where its
  # last `lookup` tokens occurred before (`rule.lookup_drafts`), and chained
  # from the model's table of its own answers where the Denoise carries one
  # (`draft_table`), in the passes where the model's own drafts are fewer.
  # The text stays the base's.
  lookup: int = 0
  # With revise: the columns of the verified head (0: the block size). The
  # model drafts a block at most, but copied and table drafts can run on, and
  # a quarter of the passes keep the whole of a block-wide head.
  head_width: int = 0
  # With revise: False runs revising passes without the masked block, so a
  # pass carries the head's token rows alone (and no adapters): the drafts
  # then come from copies and the draft table (`lookup` > 0). On a CPU, where
  # a pass costs about its token rows, that can outrun the model's drafts.
  model_drafts: bool = True
  # With lookup and a draft table: the table's chain of drafts stops where its
  # chance of holding (the product of its steps' shares in the answers it was
  # built from) falls below this. 0: the chain runs to the head's end.
  table_floor: float = 0.0
  # With model_drafts=False: the widths a pass may take, increasing, the last
  # the head's; each pass runs its products at the smallest that holds its
  # drafts (`layers.Narrow`). (): every pass is the head's width.
  pass_widths: tuple[int, ...] = ()

  def __post_init__(self):
    super().__post_init__()
    if self.head_width and not self.revise:
      raise ValueError(f"head_width={self.head_width} is the width of revision's verified head: it needs revise=True")
    if not self.model_drafts and not (self.revise and self.lookup):
      raise ValueError("model_drafts=False leaves revision's drafts to copies and the draft table: it needs"
                       f" revise=True and lookup > 0 (got revise={self.revise}, lookup={self.lookup})")
    if self.head_width and self.head_width < self.block_size:
      raise ValueError(f"head_width must be 0 or at least the block size {self.block_size}, got {self.head_width}")
    if self.revise and (not self.kv_cache or self.block_size < 2 or self.fused_head):
      raise ValueError("revise decodes against a KV cache (kv_cache=True) in blocks of at least 2, from"
                       f" materialised logits (fused_head=False); got kv_cache={self.kv_cache},"
                       f" block_size={self.block_size}, fused_head={self.fused_head}")
    if not 0.0 < self.agreement <= 1.0:
      raise ValueError(f"agreement must be in (0, 1], got {self.agreement}")
    if self.agreement < 1.0 and not self.revise:
      raise ValueError(f"agreement={self.agreement} sets how revision verifies drafts: it needs revise=True")
    if not 0 <= self.lookup <= rule.MAX_LOOKUP:
      raise ValueError(f"lookup must be in [0, {rule.MAX_LOOKUP}], got {self.lookup}")
    if self.lookup and not self.revise:
      raise ValueError(f"lookup={self.lookup} offers copied drafts for revision to verify: it needs revise=True")
    if not 0.0 <= self.table_floor <= 1.0:
      raise ValueError(f"table_floor must be in [0, 1], got {self.table_floor}")
    if self.table_floor and not self.lookup:
      raise ValueError(f"table_floor={self.table_floor} stops the draft table's chains: it needs lookup > 0")
    if self.pass_widths:
      widths, head = tuple(self.pass_widths), self.head_width or self.block_size
      if self.model_drafts:
        raise ValueError(f"pass_widths={widths} narrows passes of the head alone: it needs model_drafts=False")
      check_pass_widths(widths, head)

  def run(self, denoise: Denoise, tokens, valid, keys, lay: Layout, record: bool = False, emit=None):
    if self.revise:
      return self._run_revising(denoise, tokens, valid, keys, lay, record, emit)
    return super().run(denoise, tokens, valid, keys, lay, record, emit)

  def max_iterations(self, lay: Layout) -> int:
    return lay.gen_len + 1 if self.revise else super().max_iterations(lay)

  def _run_revising(self, denoise: Denoise, tokens, valid, keys, lay: Layout, record: bool = False, emit=None):
    """Self-speculative decoding (`rule.verify`): each pass runs a clean head
    (the base's next token and the drafts it has yet to verify) and a masked
    block right after it, which drafts the tokens that follow. The block
    slides with the text rather than standing on the block grid."""
    if lay.suffix_len:
      raise ValueError("revise writes left to right: it cannot infill against a suffix")
    bs, gs, gl = self.block_size, lay.gen_start, lay.gen_len
    hw = self.head_width or bs
    B, L = tokens.shape
    rows = jnp.arange(B)[:, None]
    lane = jnp.arange(bs, dtype=jnp.int32)[None, :]
    head_lane = jnp.arange(hw, dtype=jnp.int32)[None, :]
    widen = lambda a: jnp.pad(a, ((0, 0), (0, hw - a.shape[1])))  # noqa: E731  a block-wide head, hw columns
    pass_keys = rule.pass_keys(keys, 0, 0)  # one draw per column, shared by its drafts and its verification
    cache = denoise.new_cache(B, gs + gl + hw + bs, per_row=True)
    drafts, n_drafts = _record(jnp.zeros((gl + 2 if record else 1, B, L), jnp.int32), 0, tokens, record, emit)
    positions = denoise.positions
    pos0 = positions[:, gs]  # the first generated column's RoPE position
    table = getattr(denoise, "draft_table", None)

    def drafted(v: rule.Verified, toks, filled) -> rule.Verified:
      """`v`'s next head with copied drafts, then the table's chain (`lookup`)."""
      end = gs + filled  # the text so far and the base's next token after it
      text = toks.at[rows[:, 0], end].set(v.ahead[:, 0], mode="drop")
      col = jnp.arange(L)[None]
      known = jnp.where(col < gs, valid, col <= end[:, None])
      end = jnp.minimum(end, L - 1)
      v = rule.with_lookup(v, *rule.lookup_drafts(text, known, end, self.lookup, hw - 1))
      if table is not None:  # then the model's table of its own answers goes on from them
        context = draft_table.context_before(table, text, known, end)
        v = v.replace(**dict(zip(("ahead", "n_ahead"), table.extend(*context, v.ahead, v.n_ahead, self.table_floor))))
      return v

    zero = jnp.zeros((B,), jnp.int32)
    if self.lookup and not self.model_drafts:
      # Heads alone: the prompt's pass proposes the base's first token (scored
      # by the prompt's last state; a clean prefill, as the base's, with no
      # adapters), and the first head already carries copied and table drafts.
      logits, cache = denoise.cached(tokens[:, :gs], positions[:, :gs], cache, True, valid[:, :gs],
                                     last_only=True, clean=True)
      x0, _ = self._propose(logits, pass_keys, lane[:, :1], lay, tokens, valid)
      first = drafted(rule.Verified(keep=zero, ended=zero > 0, ahead=widen(x0), n_ahead=zero), tokens, zero)
      ahead, n_ahead = first.ahead, first.n_ahead
    else:
      # The prompt is encoded and the first tokens drafted in one pass, as cached block decoding does (a
      # masked block after the prompt, however few tokens the canvas asks for).
      first = jnp.concatenate([tokens[:, :gs], jnp.full((B, bs), lay.mask_id, tokens.dtype)], 1)
      first_pos = jnp.concatenate([positions[:, :gs], pos0[:, None] + lane], 1)
      first_valid = jnp.concatenate([valid[:, :gs], jnp.ones((B, bs), bool)], 1)
      logits, cache = denoise.cached(first, first_pos, cache, True, first_valid, gs, bs)
      x0, conf = self._propose(logits, pass_keys, lane, lay, tokens, valid)
      ahead, n_ahead = widen(x0), rule.offer(conf, self.threshold)

    def cond(s):
      return ~jnp.all(s["done"]) & (s["it"] < gl)

    def body(s):
      f, head, n_ok = s["filled"], s["ahead"], s["n_ahead"]
      at = (pos0 + f)[:, None]
      tail_lane = lane if self.model_drafts else lane[:, :1]  # without the block, the base's next token only
      blank = jnp.full((B, bs if self.model_drafts else 0), lay.mask_id, jnp.int32)
      pos = jnp.concatenate([at + head_lane, at + n_ok[:, None] + 1 + lane[:, :blank.shape[1]]], 1)
      if self.pass_widths:  # the narrowest pass that holds every running row's drafts
        need = 1 + jnp.max(jnp.where(s["done"], 0, n_ok))
        logits, pending = denoise.speculative(head, pos, s["cache"], head_lane <= n_ok[:, None], self.pass_widths,
                                              need)
      else:
        logits, pending = denoise.speculative(jnp.concatenate([head, blank], 1), pos, s["cache"],
                                              head_lane <= n_ok[:, None])
      columns = jnp.concatenate([f[:, None] + head_lane, (f + n_ok + 1)[:, None] + tail_lane], 1)
      logits = self._moved(logits, lay, s["tokens"], valid)
      x0 = rule.choose(logits, pass_keys, columns, lay.never_proposed, self.temperature, self.top_p)
      conf = rule.confidence(logits[:, hw:], x0[:, hw:], lay.never_proposed)  # the tail's alone are read
      odds = rule.draft_odds(logits[:, :hw], head, lay.never_proposed) if self.agreement < 1.0 else None
      v = rule.verify(head, n_ok, x0[:, :hw], x0[:, hw:], conf, self.threshold, lay.eos_id,
                      jnp.where(s["done"], 0, gl - f), odds, self.agreement)
      v = v.replace(ahead=widen(v.ahead))
      cols = gs + f[:, None] + head_lane
      kept = head_lane < v.keep[:, None]
      toks = s["tokens"].at[rows, cols].set(jnp.where(kept, head, s["tokens"][rows, jnp.minimum(cols, L - 1)]),
                                            mode="drop")
      filled = f + v.keep
      if self.lookup:
        v = drafted(v, toks, filled)
      rec, n = _record(s["drafts"], s["n_drafts"], toks, record, emit)
      return {"tokens": toks, "cache": pending.commit(v.keep), "filled": filled, "ahead": v.ahead,
              "n_ahead": v.n_ahead, "done": s["done"] | v.ended | (filled >= gl), "drafts": rec, "n_drafts": n,
              "it": s["it"] + 1}

    init = {"tokens": tokens, "cache": cache, "filled": zero, "ahead": ahead,
            "n_ahead": n_ahead, "done": jnp.zeros((B,), bool), "drafts": drafts,
            "n_drafts": jnp.asarray(n_drafts, jnp.int32), "it": jnp.zeros((), jnp.int32)}
    out = jax.lax.while_loop(cond, body, init)
    return {"tokens": out["tokens"], "nfe": out["it"] + 1, "steps": out["it"] + 1, "drafts": out["drafts"],
            "num_drafts": out["n_drafts"]}

  def _rule_fields(self) -> dict:
    return {"threshold": self.threshold, "min_tokens": self.min_tokens, **self._move_fields()}

  def _order_fields(self) -> dict:
    return {"in_order": self.in_order, "revise": self.revise, "agreement": self.agreement, "lookup": self.lookup,
            "table_floor": self.table_floor}

  def _steps_cap(self, lay: Layout) -> int:
    size = self.block_size if self.block_size > 0 else lay.gen_len
    return -(-min(size, lay.gen_len) // max(self.min_tokens, 1))



def check_pass_widths(widths: tuple[int, ...], head: int) -> None:
  """Pass widths increase from at least 1 to the head's width (a sampler's or an engine's)."""
  if any(w < 1 for w in widths) or list(widths) != sorted(set(widths)) or widths[-1] != head:
    raise ValueError(f"pass_widths must increase from at least 1 to the head's width {head}, got {widths}")


@dataclasses.dataclass(frozen=True)
class AncestralSampler:
  """MDLM ancestral sampling over `steps` steps from t=1 to t=eps, then one
  noise-removal step (argmax of p(x0) at every remaining [MASK]).

  With `cache=True` (for time-unconditioned models) the p(x0) of a step in
  which no token changed is reused, skipping the forward pass."""
  steps: int = 64
  temperature: float = 1.0
  schedule: str = "loglinear"
  eps: float = 1e-3
  cache: bool = True

  def max_iterations(self, lay: Layout) -> int:
    return self.steps + 1

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}")
    rule.check(threshold=0.5, min_tokens=1, temperature=self.temperature, top_p=1.0)

  def run(self, denoise: Denoise, tokens, valid, keys, lay: Layout, record: bool = False, emit=None):
    sched = Schedule(self.schedule, self.eps)
    B, L = tokens.shape
    ts = jnp.linspace(1.0, self.eps, self.steps + 1)
    drafts = jnp.zeros((self.steps + 2 if record else 1, B, L), jnp.int32)
    drafts, n_drafts = _record(drafts, 0, tokens, record, emit)

    def logits_for(tokens, t, cached, valid_cache):
      if not self.cache:
        return denoise(tokens, jnp.full((B,), t, jnp.float32)), jnp.ones((), jnp.int32)
      return jax.lax.cond(valid_cache, lambda: (cached, jnp.zeros((), jnp.int32)),
                          lambda: (denoise(tokens, jnp.full((B,), t, jnp.float32)), jnp.ones((), jnp.int32)))

    V = jax.eval_shape(denoise, tokens, jnp.zeros((B,), jnp.float32)).shape[-1]

    def body(i, s):
      s_t, t_t = ts[i], ts[i + 1]
      logits, ran = logits_for(s["tokens"], s_t, s["logits"], s["cache_ok"])
      masked = (s["tokens"] == lay.mask_id) & valid
      a_s, a_t = sched.alpha(s_t), sched.alpha(t_t)
      p_unmask = (a_t - a_s) / (1.0 - a_s)
      u = jax.vmap(lambda k: jax.random.uniform(jax.random.wrap_key_data(k), (L,)))(rule.pass_keys(keys, i, 1))
      unmask = masked & (u < p_unmask)
      x0, _ = rule.propose(logits, rule.pass_keys(keys, i, 0), jnp.arange(L), lay.never_proposed, self.temperature)
      new = jnp.where(unmask, x0, s["tokens"])
      drafts, n = _record(s["drafts"], s["n_drafts"], new, record, emit)
      return {"tokens": new, "logits": logits, "cache_ok": ~jnp.any(unmask),
              "nfe": s["nfe"] + ran, "drafts": drafts, "n_drafts": n}

    init = {"tokens": tokens, "logits": jnp.zeros((B, L, V), jnp.float32),
            "cache_ok": jnp.zeros((), bool), "nfe": jnp.zeros((), jnp.int32), "drafts": drafts,
            "n_drafts": jnp.asarray(n_drafts, jnp.int32)}
    s = jax.lax.fori_loop(0, self.steps, body, init)
    # Noise removal: whatever is still masked takes the argmax of p(x0).
    masked = (s["tokens"] == lay.mask_id) & valid
    logits, ran = jax.lax.cond(
        jnp.any(masked),
        lambda: logits_for(s["tokens"], ts[-1], s["logits"], s["cache_ok"]),
        lambda: (s["logits"], jnp.zeros((), jnp.int32)))
    x0 = argmax(rule.exclude(logits, lay.never_proposed))
    tokens = jnp.where(masked, x0, s["tokens"])
    drafts, n = _record(s["drafts"], s["n_drafts"], tokens, record, emit)
    return {"tokens": tokens, "nfe": s["nfe"] + ran, "steps": jnp.asarray(self.steps + 1, jnp.int32),
            "drafts": drafts, "num_drafts": n}


SAMPLERS = {"ancestral": AncestralSampler, "low_confidence": LowConfidenceSampler, "threshold": ThresholdSampler}
# The rules whose settings are rows of `rule.Decoding`: what the engine's shared passes serve.
RULES = {name: kind for name, kind in SAMPLERS.items() if issubclass(kind, ConfidenceSampler)}


def rule_name(sampler) -> str:
  """The name a sampler goes by in SAMPLERS (the CLI's and the server's `sampler`)."""
  return next(name for name, kind in SAMPLERS.items() if type(sampler) is kind)
