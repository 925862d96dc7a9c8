"""Fill-in-the-middle as a data transform and a prompt format (Bavarian et
al. 2022, "Efficient Training of Language Models to Fill in the Middle").

In training, a document is cut at two random character positions into
prefix, middle and suffix, and, at `rate`, moved into one of two orders:

    PSM: <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle
    SPM: <|fim_prefix|> <|fim_suffix|> suffix <|fim_middle|> prefix middle

between the usual BOS and EOS (`data.fim_level` "document"). At level
"context" the cut is made after packing instead, in token positions, to
each run of text a training row holds (`FIMFormat.context_tokens`), so
every example fits in a row whatever the document's length. A model
trained so infills left to right with prefix and suffix both before the middle, which a block-causal model's KV
cache holds: at decoding time the prompt is the PSM text up to
<|fim_middle|>, and the middle is generated until EOS. A checkpoint trained
with `data.fim_rate > 0` is decoded this way by the engine and the CLI.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

PREFIX, SUFFIX, MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"


@dataclasses.dataclass(frozen=True)
class FIMFormat:
  prefix_id: int
  suffix_id: int
  middle_id: int

  @classmethod
  def of(cls, tokenizer) -> "FIMFormat":
    """The format in `tokenizer`'s ids; ValueError naming a missing piece."""
    try:
      if not hasattr(tokenizer, "piece_id"):
        raise ValueError("the tokenizer has no FIM pieces")
      return cls(*(tokenizer.piece_id(p) for p in (PREFIX, SUFFIX, MIDDLE)))
    except ValueError as e:
      raise ValueError(f"{e}: train the tokenizer with --chat-fim-pieces for fill-in-the-middle") from None

  def prompt(self, bos_id: int | None, prefix_ids: Sequence[int], suffix_ids: Sequence[int]) -> list[int]:
    """The PSM prompt whose continuation is the middle."""
    head = [] if bos_id is None else [bos_id]
    return head + [self.prefix_id, *prefix_ids, self.suffix_id, *suffix_ids, self.middle_id]

  def training_tokens(self, tokenizer, text: str, rng: np.random.Generator, *, rate: float,
                      spm_rate: float = 0.5) -> np.ndarray:
    """[bos] + (the text, or at `rate` its PSM/SPM rearrangement) + [eos]."""
    if rng.random() >= rate or not text:
      ids = tokenizer.encode(text)
    else:
      lo, hi = np.sort(rng.integers(0, len(text) + 1, size=2))
      prefix, middle, suffix = (tokenizer.encode(part) for part in (text[:lo], text[lo:hi], text[hi:]))
      ids = self._order(prefix, middle, suffix, spm=rng.random() < spm_rate)
    return np.asarray([tokenizer.bos_id, *ids, tokenizer.eos_id], np.int32)

  def rearrange(self, ids: Sequence[int], rng: np.random.Generator, *, spm_rate: float = 0.5) -> list[int]:
    """`ids` cut at two random token positions and moved into PSM or SPM order."""
    lo, hi = np.sort(rng.integers(0, len(ids) + 1, size=2))
    return self._order(list(ids[:lo]), list(ids[lo:hi]), list(ids[hi:]), spm=rng.random() < spm_rate)

  def _order(self, prefix: Sequence[int], middle: Sequence[int], suffix: Sequence[int], *, spm: bool) -> list[int]:
    """The three parts with their markers, in SPM or PSM order."""
    if spm:
      return [self.prefix_id, self.suffix_id, *suffix, self.middle_id, *prefix, *middle]
    return [self.prefix_id, *prefix, self.suffix_id, *suffix, self.middle_id, *middle]

  def context_tokens(self, row: np.ndarray, boundaries: Sequence[int], rng: np.random.Generator, *, rate: float,
                     spm_rate: float = 0.5) -> np.ndarray:
    """Context-level FIM: a packed training row with, at `rate`, each run of
    text between `boundaries` (BOS, EOS) rearranged on its own, cut back to
    the row's length (each rearranged run adds three markers). Documents far
    longer than a row are how code comes: cut before packing, their
    prefix, suffix and middle would seldom share a row, and a model trained
    so never sees a whole PSM example of the length it infills."""
    row = np.asarray(row)
    special = np.isin(row, np.asarray(list(boundaries), row.dtype))
    out: list[int] = []
    start = 0
    for end in [*np.flatnonzero(special), len(row)]:
      run = row[start:end].tolist()
      out += self.rearrange(run, rng, spm_rate=spm_rate) if run and rng.random() < rate else run
      if end < len(row):
        out.append(int(row[end]))
      start = end + 1
    return np.asarray(out[:len(row)], row.dtype)


def format_for(config, tokenizer) -> FIMFormat | None:
  """The FIM format of a checkpoint trained with `data.fim_rate > 0`, else None."""
  if config is None or float(config.data.fim_rate) <= 0:
    return None
  return FIMFormat.of(tokenizer)
