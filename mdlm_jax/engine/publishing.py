"""What a pass means to the callers: the events each slot's new state gives
its request.

A publish reads host copies of the slots (a `Snapshot`) and, for each
request, decides what its caller sees: the current draft (for clients
watching the diffusion), the text kept since the last pass, and the end. It
touches no device state, so the engine's loop is left with the scheduling
and the passes, and the rules about text (held-back tails, stop strings,
log-probabilities of exactly the tokens a delta covers) live in one place.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mdlm_jax.engine.handle import Handle
from mdlm_jax.engine.requests import Event
from mdlm_jax.sampling.detokenize import IncrementalText
from mdlm_jax.sampling.finish import finish, tokens_for_text
from mdlm_jax.sampling.generate import draft_text


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """Host copies of the slot state a publish reads, one row a slot.

  `kept`: tokens kept in order (finished blocks', or a revising row's
  verified tokens); `ahead`: what a revising row offers past them (the
  base's next token and the drafts), [MASK] elsewhere; `logprobs`: the
  (log-probability, top ids, top log-probabilities) arrays after a pass that
  computed them, else None."""
  gen: np.ndarray
  kept: np.ndarray
  active: np.ndarray
  passes: np.ndarray
  head: np.ndarray
  ahead: np.ndarray
  logprobs: tuple | None = None

  @classmethod
  def of_slots(cls, gen, block, active, passes, head, revise, filled, ahead, n_ahead, *, block_size: int,
               mask_id: int, logprobs=None) -> "Snapshot":
    """From the slot state's own fields (`block`: finished blocks; `filled`
    and `n_ahead`: a revising row's verified tokens and drafts offered)."""
    kept = np.where(revise, filled, block * block_size)
    shown = (np.arange(ahead.shape[1])[None] <= n_ahead[:, None]) & revise[:, None]
    return cls(gen, kept, active, passes, head, np.where(shown, ahead, mask_id), logprobs)


def events_for(h: Handle, row: int, snap: Snapshot, tok) -> tuple[list[Event], Event | None]:
  """The events row `row`'s state gives request `h` since the last publish:
  those to push now, and its "done" event if it ended (the engine frees the
  slot with it). Updates the handle's record of what it has sent."""
  active, kept = bool(snap.active[row]), int(snap.kept[row])
  if not h.want_drafts and active and kept == h.kept_seen:
    return [], None  # nothing kept since the last pass: no new text, no end
  h.kept_seen = kept
  r, out = h.request, []
  ids = snap.gen[row, :r.max_tokens]
  if h.detokenizer is None:
    h.detokenizer = IncrementalText(tok)
  end = finish(tok, ids[:kept], max_tokens=r.max_tokens, stop=r.stop, final=not active, text_of=h.detokenizer.text)
  text, done = end.text, end.done
  passes = int(snap.passes[row])
  if h.want_drafts:
    # Every committed token shows in a draft, held-back text included; a
    # revising row's drafts too, until the base takes them back.
    shown = ids
    if r.sampler.revises and not done:
      shown = ids.copy()
      w = snap.ahead.shape[1]  # the head's columns
      shown[kept:kept + w] = snap.ahead[row][:len(shown[kept:kept + w])]
    out.append(Event("draft", text if done else draft_text(tok, shown), passes=passes))
  # `finish` holds back what a later block could still change (a split
  # character, the start of a stop string): the rest is sent once.
  if len(text) > len(h.emitted) and text.startswith(h.emitted):
    entries = None
    if r.logprobs is not None:  # the tokens the text covers: only a request with logprobs needs them
      covered = len(end.tokens) if done else tokens_within(tok, end.tokens, len(text))
      entries = h.logprob_entries(snap.gen[row], row, snap.logprobs, covered)
    out.append(Event("delta", text[len(h.emitted):], passes=passes, logprobs=entries))
    h.emitted = text
  if not done:
    return out, None
  return out, Event("done", h.emitted, end.reason, completion_tokens=len(end.tokens), passes=passes,
                    logprobs=h.logprob_entries(snap.gen[row], row, snap.logprobs, len(end.tokens)),
                    stopped_by=end.stopped_by)


def tokens_within(tok, ids, n_chars: int) -> int:
  """How many leading tokens of `ids` decode to at most `n_chars` characters
  (a token whose text a held-back tail splits waits for the next event)."""
  m = tokens_for_text(tok, ids, n_chars + 1)
  return m - 1 if len(tok.decode(list(ids[:m]))) > n_chars else m
