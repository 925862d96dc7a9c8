"""Where a generation ends, and what it returns.

One rule for every decoder (the one-shot samplers, the AR twin, the serving
engine): the text runs up to the first EOS, the first stop string or
`max_tokens`, whichever comes first, and the tokens reported with it (what
`usage` counts) are exactly those that produced the returned text.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

REPLACEMENT = "\ufffd"  # how a character split across tokens decodes until its last byte is in


@dataclasses.dataclass(frozen=True)
class Finished:
  """`reason`: "stop" (EOS or a stop string), "length" (max_tokens or the
  decoder's end), or None while more tokens may still come; `text` is then
  the part that no later token can change (safe to stream)."""
  text: str
  tokens: list[int]
  reason: str | None
  stopped_by: str | None = None  # the stop string that cut it, if one did

  @property
  def done(self) -> bool:
    return self.reason is not None


def first_stop(text: str, stop: Sequence[str]) -> int:
  """Index in `text` where the earliest stop string starts; -1 if none occurs."""
  return min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)


def tokens_for_text(tok, ids: Sequence[int], n_chars: int) -> int:
  """The fewest leading tokens of `ids` whose text reaches `n_chars` characters
  (binary search: the decoded length never shrinks as tokens are added)."""
  lo, hi = 0, len(ids)
  while lo < hi:
    mid = (lo + hi) // 2
    if len(tok.decode(list(ids[:mid]))) >= n_chars:
      hi = mid
    else:
      lo = mid + 1
  return lo


def finish(tok, ids: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), final: bool = True,
           text_of: Callable[[Sequence[int]], str] | None = None) -> Finished:
  """The generation so far, `ids` (committed tokens in order, no masks), cut
  by the rule above. `final`: the decoder will add nothing more, so a
  generation that met no EOS or stop string ended by length. `text_of`: what
  decodes `ids` (default `tok.decode`; a stream's `IncrementalText.text`)."""
  arr = np.asarray(ids, np.int64).reshape(-1)[:max_tokens]
  at_eos = np.flatnonzero(arr == tok.eos_id)
  eos = int(at_eos[0]) if at_eos.size else -1
  ids = (arr[:eos] if eos >= 0 else arr).tolist()
  text = (text_of or tok.decode)(ids)
  cut = first_stop(text, stop)
  if cut >= 0:
    by = max((x for x in stop if x and text.startswith(x, cut)), key=len)
    return Finished(text[:cut], ids[:tokens_for_text(tok, ids, cut)], "stop", by)
  if eos >= 0:
    return Finished(text, ids, "stop")
  if final or len(ids) >= max_tokens:
    return Finished(text, ids, "length")
  # A character split across tokens decodes as U+FFFD until its last token is in,
  # and a tail that may grow into a stop string is held back until it does not.
  text = text.rstrip(REPLACEMENT)
  return Finished(text[:len(text) - _stop_prefix_tail(text, stop)], ids, None)


def _stop_prefix_tail(text: str, stop: Sequence[str]) -> int:
  """Length of the longest end of `text` that begins some stop string."""
  return max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
             default=0)


__all__ = ["Finished", "finish", "first_stop", "tokens_for_text"]
