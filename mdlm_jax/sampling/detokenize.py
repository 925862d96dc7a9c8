"""The text of a growing sequence of ids, in time proportional to what is new.

A streaming request's text is needed after every pass (stop strings, held-back
tails, the delta sent), and decoding the whole answer each time costs a pass
O(answer) host work: O(n^2) over a long answer. `IncrementalText` decodes
only a window: the last few tokens of a settled prefix and whatever came
after them. The window's own rendering of those context tokens is cut off
the front, which absorbs what a decoder does at a sequence's start (a
SentencePiece word's leading space dropped, a byte-level character split at
the window's edge), and the rest is appended to the prefix's text.

A prefix is settled when its text does not end in U+FFFD (a character whose
last bytes are still to come). The window is used only where it renders
visible text for its context tokens (not empty or whitespace alone, which a
decoder may strip) and its longer decode begins with that text; anything
else (the ids no longer extend the settled prefix, say) decodes whole.
The result equals `tok.decode(ids)`: tests check it against that on random
ids for byte-level BPE, Metaspace and SentencePiece vocabularies and a
decoder that strips leading whitespace.
"""

from __future__ import annotations

import numpy as np

from mdlm_jax.sampling.finish import REPLACEMENT

CONTEXT_TOKENS = 8  # settled tokens decoded again in front of the new ones


class IncrementalText:
  """`text(ids)` == `tok.decode(ids)`, for a sequence that mostly grows."""

  def __init__(self, tok, context: int = CONTEXT_TOKENS):
    if context < 1:
      raise ValueError(f"context must be at least 1 token, got {context}")
    self._tok, self._context = tok, context
    self._ids: list[int] = []  # the settled prefix
    self._text = ""  # its text
    self._start = 0  # where its window begins
    self._window = ""  # the window's rendering of ids[_start:len(_ids)]
    self.full_decodes = 0  # how often a call decoded every id (for tests and profiles)

  def text(self, ids: list[int] | np.ndarray) -> str:
    if not isinstance(ids, list):
      ids = np.asarray(ids, np.int64).reshape(-1).tolist()
    n = len(self._ids)
    if n and len(ids) >= n and ids[:n] == self._ids and self._window.strip():
      new = self._tok.decode(ids[self._start:])
      if new.startswith(self._window):
        text = self._text + new[len(self._window):]
        self._settle(ids, text, new)
        return text
    self.full_decodes += 1
    text = self._tok.decode(ids)
    self._ids = []
    self._settle(ids, text, None)
    return text

  def _settle(self, ids: list[int], text: str, window: str | None) -> None:
    """Makes `ids` the settled prefix if its text is final. `window`: the
    rendering of ids[_start:], if just decoded; the window keeps its start
    until it spans twice the context, then starts `context` ids back."""
    if text.endswith(REPLACEMENT):
      return
    if window is None or len(ids) - self._start > 2 * self._context:
      self._start = max(0, len(ids) - self._context)
      window = self._tok.decode(ids[self._start:])
    self._ids, self._text, self._window = ids, text, window


__all__ = ["CONTEXT_TOKENS", "IncrementalText"]
