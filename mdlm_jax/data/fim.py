"""Fill-in-the-middle as a data transform and a prompt format (Bavarian et
al. 2022, "Efficient Training of Language Models to Fill in the Middle").

In training, a document is cut at two random character positions into
prefix, middle and suffix, and, at `rate`, moved into one of two orders:

    PSM: <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle
    SPM: <|fim_prefix|> <|fim_suffix|> suffix <|fim_middle|> prefix middle

between the usual BOS and EOS. A model trained so infills left to right with
prefix and suffix both before the middle, which a block-causal model's KV
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
    if not hasattr(tokenizer, "piece_id"):
      raise ValueError("fill-in-the-middle needs a tokenizer with the FIM pieces (train one with"
                       " `python -m mdlm_jax.tokenizer train --chat-fim-pieces`)")
    try:
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
      if rng.random() < spm_rate:
        ids = [self.prefix_id, self.suffix_id, *suffix, self.middle_id, *prefix, *middle]
      else:
        ids = [self.prefix_id, *prefix, self.suffix_id, *suffix, self.middle_id, *middle]
    return np.asarray([tokenizer.bos_id, *ids, tokenizer.eos_id], np.int32)


def format_for(config, tokenizer) -> FIMFormat | None:
  """The FIM format of a checkpoint trained with `data.fim_rate > 0`, else None."""
  if config is None or float(config.data.get("fim_rate", 0.0)) <= 0:
    return None
  return FIMFormat.of(tokenizer)
