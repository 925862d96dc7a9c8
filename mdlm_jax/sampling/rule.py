"""The one refinement rule every diffusion decoder here applies, once per pass:

1. propose: at each undecided position, a token x0 (Gumbel-max at the row's
   temperature over its top-p nucleus; argmax at temperature 0) and its
   probability under the untempered p(x0), [MASK] excluded (SUBS);
2. commit: every proposal at least `threshold` sure, and never fewer than
   the floor (the most confident first, or with `in_order` the leftmost
   first: an AR model adapted to diffusion always commits the position its
   base predicts exactly). The floor is `min_tokens`, or with `steps` an
   even share of what the block has left over the passes it has left
   (`floor`). Fast-dLLM's rule is threshold 0.9, floor 1; LLaDA's
   low-confidence remasking is threshold never, `steps` passes a block;
3. revise (`revise`, an AR model adapted to diffusion only): drafts are
   kept only while the base's own causal pass proposes them too (`verify`),
   so the text is the base's and the drafts buy speed; with `agreement`
   below 1, also while the base finds a draft at least that share as
   likely as its own choice (lossy: text near the base's, more speed);
4. constrain (rows under a grammar only): `allow` masks the logits at the
   row's first undecided column to what the grammar allows there, and the
   host commits the longest grammatical prefix (`sampling.grammar`).

Before the proposal a row's logits may be moved (`penalize`): OpenAI's
logit_bias, presence_penalty and frequency_penalty, the counts being the
tokens the row has committed so far anywhere in its generation region
(diffusion commits out of order). Proposal and confidence both read the
moved logits, so a banned token is never proposed and a penalised one needs
more certainty to pass the threshold.

Both are vectorised over rows with per-row settings, so requests of different
efforts share one pass (the engine), and the one-shot samplers call the same
functions with their settings broadcast over the batch.

Noise: a row's draw at a position depends only on the row's key, the pass
(`keys` are folded per pass by the caller) and the position's column in the
generation region, so a row decodes the same alone or in any batch, and a
block decoded against a KV cache draws what it would draw in the full canvas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from mdlm_jax import kernels
from mdlm_jax.kernels.numerics import NEG_INF
from mdlm_jax.sampling.gumbel import argmax, gumbel_argmax, random_words, top_p_filter

NEVER = 2.0  # a threshold no probability reaches: commit by rank alone
MAX_LOGIT_BIAS = 300  # the most logit_bias entries a row may carry
NO_BIAS_ID = 2 ** 30  # a free logit_bias entry: an id past any vocabulary, dropped by the scatter


@struct.dataclass
class Decoding:
  """Per-row settings of the rule, each an array over rows (a pytree: jit
  traces it, and the engine keeps one row per slot)."""
  threshold: Float[Array, "b"]
  min_tokens: Int[Array, "b"]
  in_order: Bool[Array, "b"]  # the floor's tokens are the leftmost undecided, not the most confident
  revise: Bool[Array, "b"]  # drafts kept only where the base agrees (`verify`)
  agreement: Float[Array, "b"]  # with revise: the least p(draft) / p(base's best) kept (1: its choice only)
  lookup: Int[Array, "b"]  # with revise: > 0 offers drafts copied after this many matching tokens (`lookup_drafts`)
  table_floor: Float[Array, "b"]  # with lookup: the draft table's chain stops below this chance (`DraftTable.extend`)
  steps: Int[Array, "b"]  # > 0: a block ends after this many passes, its floor spread evenly over them (`floor`)
  temperature: Float[Array, "b"]
  top_p: Float[Array, "b"]
  presence_penalty: Float[Array, "b"]
  frequency_penalty: Float[Array, "b"]
  bias_ids: Int[Array, "b k"]  # logit_bias token ids, NO_BIAS_ID where free (k = MAX_LOGIT_BIAS)
  bias: Float[Array, "b k"]

  @classmethod
  def broadcast(cls, rows: int, *, threshold: float, min_tokens: int, temperature: float = 0.0,
                top_p: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                logit_bias: tuple[tuple[int, float], ...] = (), in_order: bool = False,
                revise: bool = False, agreement: float = 1.0, lookup: int = 0, table_floor: float = 0.0,
                steps: int = 0) -> "Decoding":
    full = lambda v, dtype: np.full((rows,), v, dtype)  # noqa: E731  (host arrays: no dispatch per request)
    ids, values = bias_arrays(logit_bias)
    return cls(full(threshold, np.float32), full(min_tokens, np.int32), full(in_order, bool), full(revise, bool),
               full(agreement, np.float32), full(lookup, np.int32), full(table_floor, np.float32),
               full(steps, np.int32), full(temperature, np.float32), full(top_p, np.float32),
               full(presence_penalty, np.float32), full(frequency_penalty, np.float32),
               np.tile(ids, (rows, 1)), np.tile(values, (rows, 1)))


def bias_arrays(logit_bias: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray]:
  """A row's logit_bias as fixed-size (ids [MAX_LOGIT_BIAS] int32, values
  float32), the free entries NO_BIAS_ID and 0."""
  ids = np.full((MAX_LOGIT_BIAS,), NO_BIAS_ID, np.int32)
  values = np.zeros((MAX_LOGIT_BIAS,), np.float32)
  for i, (tok, value) in enumerate(logit_bias):
    ids[i], values[i] = tok, value
  return ids, values


def token_counts(tokens: Int[Array, "b l"], counted: Bool[Array, "b l"], vocab: int) -> Float[Array, "b v"]:
  """How often each id occurs among a row's `counted` tokens."""
  ids = jnp.where(counted, tokens, vocab)  # past the vocabulary: dropped
  return jax.vmap(lambda r: jnp.zeros((vocab,), jnp.float32).at[r].add(1.0, mode="drop"))(ids)


def penalize(logits: Float[Array, "b t v"], counts: Float[Array, "b v"], presence_penalty, frequency_penalty,
             bias_ids: Int[Array, "b k"], bias: Float[Array, "b k"]) -> Float[Array, "b t v"]:
  """float32 logits moved as OpenAI's API moves them, per row:
  logit[v] + bias[v] - presence_penalty * [count[v] > 0] - frequency_penalty * count[v].
  Penalties are [B] arrays or scalars; the same move for every position of a row."""
  return logits.astype(jnp.float32) + penalty(counts, presence_penalty, frequency_penalty, bias_ids, bias)[:, None, :]


def penalty(counts: Float[Array, "b v"], presence_penalty, frequency_penalty, bias_ids: Int[Array, "b k"],
            bias: Float[Array, "b k"]) -> Float[Array, "b v"]:
  """What `penalize` adds to each row's logits."""
  b, v = counts.shape
  dense = jax.vmap(lambda i, x: jnp.zeros((v,), jnp.float32).at[i].add(x, mode="drop"))(
      jnp.asarray(bias_ids, jnp.int32), jnp.asarray(bias, jnp.float32))
  per_row = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (b,))[:, None]  # noqa: E731
  return dense - per_row(presence_penalty) * (counts > 0) - per_row(frequency_penalty) * counts


def pass_keys(key_data: jax.Array, *ids) -> jax.Array:
  """Per-row keys [B, 2] for one pass: each row's key folded with the pass's
  identifiers (scalars or per-row arrays: block, step, ...)."""
  def one(k, *row_ids):
    k = jax.random.wrap_key_data(k)
    for i in row_ids:
      k = jax.random.fold_in(k, i)
    return jax.random.key_data(k)
  b = key_data.shape[0]
  return jax.vmap(one)(key_data, *(jnp.broadcast_to(jnp.asarray(i, jnp.int32), (b,)) for i in ids))


def row_keys(seeds: Int[Array, "b"]) -> jax.Array:
  """Key data [B, 2] of one PRNG key per row, from per-row seeds."""
  return jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(jnp.asarray(seeds, jnp.uint32))


def noise_words(keys: jax.Array, columns, vocab: int) -> jax.Array:
  """Random words [2, B, T, V]; row b, column t from keys[b] and its column
  alone. `columns`: [T] shared by the rows, or [B, T]."""
  columns = jnp.asarray(columns, jnp.int32)
  columns = jnp.broadcast_to(columns, (keys.shape[0], columns.shape[-1]))

  def row(k, cols):
    k = jax.random.wrap_key_data(k)
    return jax.vmap(lambda c: random_words(jax.random.fold_in(k, c), (vocab,)))(cols)  # [T, 2, V]
  return jnp.transpose(jax.vmap(row)(keys, columns), (2, 0, 1, 3))


def exclude(logits, ids: tuple[int, ...]):
  """float32 logits with `ids` at NEG_INF: tokens no pass proposes. A select
  against a constant mask rather than a scatter, so it fuses into whatever
  reads the logits next instead of writing a copy of them."""
  logits = logits.astype(jnp.float32)
  if not ids:
    return logits
  banned = np.zeros((logits.shape[-1],), bool)
  banned[list(ids)] = True
  return jnp.where(banned, NEG_INF, logits)


def propose(logits, keys: jax.Array, columns, never: tuple[int, ...], temperature, top_p=1.0):
  """(x0 [B, T] int32, confidence [B, T] float32) for one pass; `keys` [B, 2]
  this pass's row keys (`pass_keys`), `columns` [T] or [B, T] the positions'
  columns in the generation region, `never` the ids no position may take
  ([MASK] and the read-only markers: `Layout.never_proposed`).

  `temperature`, `top_p`: Python floats (settings fixed at trace time) or
  per-row arrays [B]. `logits` may be a `kernels.HeadInput`: with a static
  temperature and no nucleus, the fused confidence head samples from the same
  noise bits without materialising the logits where a kernel runs."""
  static = isinstance(temperature, (int, float)) and isinstance(top_p, (int, float))
  if isinstance(logits, kernels.HeadInput):
    head = logits
    if head.fused and static and top_p >= 1.0:
      bits = noise_words(keys, columns, head.w_dv.shape[1])[0] if temperature > 0 else None
      x0, conf, _ = kernels.confidence_head(head.hidden, head.w_dv, bits,
                                            kernels.HeadSettings(float(temperature), tuple(never)),
                                            implementation=head.implementation)
      return x0, conf
    logits = head.logits()
  x0 = choose(logits, keys, columns, never, temperature, top_p)
  return x0, confidence(logits, x0, never)


def choose(logits, keys: jax.Array, columns, never: tuple[int, ...], temperature, top_p=1.0):
  """`propose`'s x0 alone (materialised logits): where a caller reads the
  confidence of a few columns only, it takes `confidence` of those, and the
  vocabulary's normaliser is not summed for the rest."""
  static = isinstance(temperature, (int, float)) and isinstance(top_p, (int, float))
  logits = exclude(logits, tuple(never))
  greedy = argmax(logits)

  def sampled():
    b, t, v = logits.shape
    temp = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
    scaled = logits / jnp.where(temp > 0, temp, 1.0)[:, None, None]
    if not (static and top_p >= 1.0):
      nucleus = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))[:, None, None]
      scaled = lax.cond(jnp.any(nucleus < 1), lambda: top_p_filter(scaled, nucleus), lambda: scaled)
    x = gumbel_argmax(scaled, noise_words(keys, columns, v))
    return jnp.where((temp > 0)[:, None], x, greedy)

  if static:
    return sampled() if temperature > 0 else greedy
  return lax.cond(jnp.any(jnp.asarray(temperature) > 0), sampled, lambda: greedy)


def confidence(logits, x0, never: tuple[int, ...]):
  """p(x0) [B, T] under the logits at temperature 1, `never` excluded, from
  the log-normaliser alone: no [B, T, V] log-softmax is written."""
  logits = exclude(logits, tuple(never))
  at = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
  return jnp.exp(at - jax.nn.logsumexp(logits, axis=-1))


def rank_desc(scores):
  """0 for the largest score of each row, 1 for the next, ... (ties by index)."""
  order = jnp.argsort(-scores, axis=-1, stable=True)
  return jnp.argsort(order, axis=-1, stable=True)


def commit(conf: Float[Array, "b t"], candidates: Bool[Array, "b t"], threshold, min_tokens,
           in_order=False) -> Bool[Array, "b t"]:
  """Which candidates to commit: those at least `threshold` sure, and the
  `min_tokens` most confident of each row, or with `in_order` its
  `min_tokens` leftmost ([B] arrays or scalars)."""
  conf = jnp.where(candidates, conf, -1.0)
  by_position = jnp.cumsum(candidates, axis=-1) - 1  # among the candidates, left to right
  order = jnp.where(jnp.asarray(in_order)[..., None], by_position, rank_desc(conf))
  top = order < jnp.asarray(min_tokens)[..., None]
  return candidates & ((conf >= jnp.asarray(threshold)[..., None]) | top)


def picks(d: Decoding, conf: Float[Array, "b t"], candidates: Bool[Array, "b t"], step) -> Bool[Array, "b t"]:
  """Which candidates a pass commits under each row's settings `d`, on its
  block's `step`-th pass ([B] array or scalar): step 2 of the rule."""
  return commit(conf, candidates, d.threshold, floor(d, candidates, step), d.in_order)


def floor(d: Decoding, candidates: Bool[Array, "b t"], step) -> Int[Array, "b"]:
  """Each row's floor for this pass: `min_tokens`, or for a row with `steps`
  what its block has left split evenly over the passes left (the block's
  `step`-th pass, counted from 0; the last takes all), LLaDA's schedule
  computed on the fly, so the block ends after exactly `steps` passes."""
  n_left = jnp.sum(candidates, axis=-1).astype(jnp.int32)
  steps = jnp.asarray(d.steps, jnp.int32)
  passes_left = steps - jnp.asarray(step, jnp.int32)
  share = jnp.where(passes_left > 0, -(-n_left // jnp.maximum(passes_left, 1)), n_left)
  return jnp.where(steps > 0, share, jnp.asarray(d.min_tokens, jnp.int32))


def offer(conf: Float[Array, "b t"], threshold) -> Int[Array, "b"]:
  """How many drafts of a block a revising pass sends ahead, after the
  block's first token (the base's own, from the clean state before it):
  those at least `threshold` sure up to the first that is not ([B] array or
  scalar). A draft that fails costs the drafts behind it, so unlikely ones
  stay home."""
  sure = conf[:, 1:] >= jnp.asarray(threshold, jnp.float32)[..., None]
  return jnp.sum(jnp.cumprod(sure, axis=1), axis=1).astype(jnp.int32)


@struct.dataclass
class Verified:
  """What a revising pass keeps (`verify`)."""
  keep: Int[Array, "b"]  # head tokens kept, in order
  ended: Bool[Array, "b"]  # the kept tokens end the text (EOS)
  ahead: Int[Array, "b t"]  # the next pass's head: the base's next token, then drafts
  n_ahead: Int[Array, "b"]  # drafts offered in it


def draft_odds(logits: Float[Array, "b t v"], head: Int[Array, "b t"], never: tuple[int, ...]) -> Float[Array, "b t"]:
  """log p(head token) - log p(most likely token) at each head column, under
  the (moved) logits at temperature 1, `never` excluded: how far a draft is
  from the base's own first choice (0 where it is that choice)."""
  logits = exclude(logits, tuple(never))
  at = jnp.take_along_axis(logits, head[..., None], axis=-1)[..., 0]
  return (at - jnp.max(logits, axis=-1)).astype(jnp.float32)


def odds_where_asked(logits: Float[Array, "b n v"], head: Int[Array, "b t"], never: tuple[int, ...],
                     agreement) -> Float[Array, "b t"]:
  """`draft_odds` of the head's columns, the first `head.shape[1]` of
  `logits`, where some row's `agreement` ([B]) is below 1, else zeros:
  `verify` reads the odds only there. On CPU a conditional skips the pass
  over the head's logits (about 0.15 ms of a revising pass; the whole
  logits go in, since a slice handed to a conditional is copied); an
  accelerator would read its predicate on the host every pass, so there the
  odds are always computed."""
  odds = lambda: draft_odds(logits[:, :head.shape[1]], head, never)  # noqa: E731
  if jax.default_backend() != "cpu":
    return odds()
  return lax.cond(jnp.any(jnp.asarray(agreement) < 1.0), odds, lambda: jnp.zeros(head.shape, jnp.float32))


def verify(head: Int[Array, "b t"], n_drafts: Int[Array, "b"], base: Int[Array, "b t"], tail: Int[Array, "b t"],
           tail_conf: Float[Array, "b t"], threshold, eos_id: int, room: Int[Array, "b"],
           odds: Float[Array, "b t"] | None = None, agreement=1.0) -> Verified:
  """Revision by the base (an AR model adapted to diffusion). `head` is the
  base's next token and `n_drafts` drafts after it, run through the base's
  causal stream: `base[:, i]` is the base's proposal for head column i given
  the head before it. Drafts are kept while they equal it; the first that
  does not is taken back, and the base's proposal there is the next token.
  `tail` is the block proposed after the head's drafts: when every draft
  held, its first token is the base's next one and its drafts are offered
  next (`offer`). Every kept token is thus the base's own proposal given the
  kept text: the output is the base's decoding, drafts set only the speed.
  A pass keeps at least one token (`room` permitting: 0 for a finished row),
  nothing after EOS. `n_drafts` -1: the head is empty (a row's first pass
  after its prompt), the tail starts the text.

  `agreement` < 1 ([B] array or scalar; `odds` from `draft_odds`): a draft
  the base did not choose is kept too when the base finds it at least that
  share as likely as its most likely token. The text is then no longer the
  base's, but every kept token is one the base rates close to its best."""
  t = head.shape[1]
  lane = jnp.arange(t, dtype=jnp.int32)[None, :]
  agrees = head[:, 1:] == base[:, 1:]
  if odds is not None:
    agreement = jnp.asarray(agreement, jnp.float32)[..., None]
    near = (agreement < 1.0) & (odds[:, 1:] >= jnp.log(jnp.maximum(agreement, 1e-30)))
    agrees = agrees | near
  holds = agrees & (lane[:, 1:] <= n_drafts[:, None])
  held = jnp.sum(jnp.cumprod(holds, axis=1), axis=1).astype(jnp.int32)
  empty = n_drafts < 0
  keep = jnp.where(empty, 0, 1 + held)
  eos = (head == eos_id) & (lane < keep[:, None])
  keep = jnp.minimum(jnp.where(jnp.any(eos, 1), jnp.argmax(eos, 1).astype(jnp.int32) + 1, keep), room)
  ended = jnp.any((head == eos_id) & (lane < keep[:, None]), 1)
  all_held = (held == n_drafts) | empty
  nxt = jnp.where(all_held, tail[:, 0], jnp.take_along_axis(base, jnp.minimum(held + 1, t - 1)[:, None], 1)[:, 0])
  return Verified(keep, ended, jnp.concatenate([nxt[:, None], tail[:, 1:]], 1),
                  jnp.where(all_held, offer(tail_conf, threshold), 0))


MAX_LOOKUP = 4  # the most matching tokens `lookup_drafts` may ask for
LOOKUP_SPAN = 8  # the longest suffix `lookup_drafts` compares: the longest match wins


def lookup_drafts(text: Int[Array, "b l"], known: Bool[Array, "b l"], end: Int[Array, "b"], n,
                  width: int) -> tuple[Int[Array, "b w"], Int[Array, "b"]]:
  """Drafts copied from earlier in the text (prompt lookup): where the
  tokens ending at `end` (the last known position) occurred before, the up
  to `width` tokens that followed them there. Code answers restate their
  prompt's signatures and names, and edits copy most of their input, so such
  drafts often hold where a model's own run out. Of the earlier occurrences
  of at least the last `n` tokens, the one that matches the most of the last
  LOOKUP_SPAN wins, the most recent among equals: a longer match continues
  as the text does more often (on the base's own code completions, 2.51
  tokens a pass against 2.48 for the most recent two-token match). `n` ([B]
  array or scalar, at most MAX_LOOKUP; 0: none). Returns (drafts, count
  [B]); count 0 where no occurrence matched."""
  b, length = text.shape
  n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (b,))
  idx = jnp.arange(length, dtype=jnp.int32)[None]
  run = idx < end[:, None]  # still matching after j tokens
  matched = jnp.zeros((b, length), jnp.int32)
  for j in range(LOOKUP_SPAN):
    want = jnp.take_along_axis(text, jnp.maximum(end - j, 0)[:, None], 1)
    want_known = (end - j >= 0)[:, None] & jnp.take_along_axis(known, jnp.maximum(end - j, 0)[:, None], 1)
    here = jnp.pad(text, ((0, 0), (j, 0)))[:, :length]  # here[p] = text[p - j]
    here_known = jnp.pad(known, ((0, 0), (j, 0)))[:, :length]
    run &= want_known & here_known & (here == want)
    matched += run.astype(jnp.int32)
  ok = (matched >= n[:, None]) & (n[:, None] > 0)
  found = jnp.any(ok, axis=1)
  at = jnp.argmax(jnp.where(ok, matched * length + idx, -1), axis=1).astype(jnp.int32)  # longest, then latest
  lane = jnp.arange(width, dtype=jnp.int32)[None]
  drafts = jnp.take_along_axis(text, jnp.clip(at[:, None] + 1 + lane, 0, length - 1), 1)
  return drafts, jnp.where(found, jnp.minimum(width, end - at), 0).astype(jnp.int32)


def with_lookup(v: "Verified", drafts: Int[Array, "b w"], count: Int[Array, "b"]) -> "Verified":
  """The next head offers the copied drafts (`lookup_drafts`, continuing
  from the base's next token `v.ahead[:, 0]`) where they are more than the
  model's own: after a failed draft the model has none, and copied text is
  often long where the model is unsure."""
  use = count > v.n_ahead
  ahead = jnp.concatenate([v.ahead[:, :1], drafts[:, :v.ahead.shape[1] - 1]], 1)
  return v.replace(ahead=jnp.where(use[:, None], ahead, v.ahead), n_ahead=jnp.where(use, count, v.n_ahead))


def allow(logits: Float[Array, "... v"], bitmask) -> Float[Array, "... v"]:
  """`logits` with every token a grammar forbids at NEG_INF: `bitmask`
  [..., ceil(v / 32)] uint32, bit v % 32 of word v // 32 set where token v is
  allowed (llguidance's layout)."""
  v = logits.shape[-1]
  ids = jnp.arange(v, dtype=jnp.uint32)
  words = jnp.take(jnp.asarray(bitmask, jnp.uint32), (ids // 32).astype(jnp.int32), axis=-1)
  ok = ((words >> (ids % 32)) & 1).astype(bool)
  return jnp.where(ok, logits, NEG_INF)


def bias_pairs(logit_bias) -> tuple[tuple[int, float], ...]:
  """A logit_bias given as {id: bias} or as pairs, as hashable (id, bias)
  pairs: samplers holding it are static arguments."""
  items = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias
  return tuple((t, float(b)) for t, b in items)


def check(*, threshold: float, min_tokens: int, steps: int = 0, temperature: float, top_p: float,
          presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias: tuple[tuple[int, float], ...] = (),
          vocab_size: int | None = None) -> None:
  """The one validator of the rule's settings (ValueError naming the field)."""
  check_moves(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=logit_bias,
              vocab_size=vocab_size)
  if not 0.0 <= threshold <= 1.0 and threshold != NEVER:
    raise ValueError(f"threshold must be in [0, 1], got {threshold}")
  if min_tokens < 1:
    raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
  if steps < 0:
    raise ValueError(f"steps must be >= 0 (0: no schedule), got {steps}")
  if not 0.0 <= temperature <= 100.0:
    raise ValueError(f"temperature must be in [0, 100], got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def check_moves(*, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                logit_bias: tuple[tuple[int, float], ...] = (), vocab_size: int | None = None) -> None:
  """The logit moves' part of `check` (the AR sampler's too); with
  `vocab_size`, logit_bias's ids are checked against the model's vocabulary."""
  for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
    if not -2.0 <= value <= 2.0:
      raise ValueError(f"{name} must be in [-2, 2], got {value}")
  if len(logit_bias) > MAX_LOGIT_BIAS:
    raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(logit_bias)}")
  seen = set()
  for tok, value in logit_bias:
    if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)) or tok < 0:
      raise ValueError(f"logit_bias: token ids must be non-negative integers, got {tok!r}")
    if vocab_size is not None and tok >= vocab_size:
      raise ValueError(f"logit_bias: token id {tok} is outside the vocabulary of {vocab_size}")
    if tok in seen:
      raise ValueError(f"logit_bias: token id {tok} appears twice")
    seen.add(tok)
    if not -100.0 <= value <= 100.0:
      raise ValueError(f"logit_bias: the bias of token {tok} must be in [-100, 100], got {value}")


__all__ = ["Decoding", "MAX_LOGIT_BIAS", "NEVER", "allow", "bias_arrays", "bias_pairs", "check", "check_moves",
           "choose", "commit", "confidence", "draft_odds", "floor", "noise_words", "odds_where_asked", "offer",
           "pass_keys", "penalize", "penalty", "picks", "propose", "rank_desc", "row_keys", "token_counts", "verify",
           "Verified"]
