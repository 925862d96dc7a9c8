"""The fixed-shape canvas every diffusion sampler refines.

Row layout: [left pad][prompt][generation region][suffix][right pad]. Pads
are invalid (never attended to, never changed); prompt and suffix tokens are
fixed; the generation region starts as [MASK]. Row lengths are bucketed so
that prompts of similar length share one compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Canvas:
  tokens: np.ndarray     # int32 [B, L]
  valid: np.ndarray      # bool  [B, L]: not padding
  fixed: np.ndarray      # bool  [B, L]: prompt/suffix/padding, never changed
  positions: np.ndarray  # int32 [B, L]: RoPE positions, 0 at the first real token
  gen_start: int         # the generation region is [gen_start, gen_start + gen_len)
  gen_len: int

  @property
  def shape(self):
    return self.tokens.shape


def bucket(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


def make_canvas(prompts: Sequence[Sequence[int]], gen_len: int, *, mask_id: int, pad_id: int,
                suffixes: Sequence[Sequence[int]] | None = None, multiple: int = 16) -> Canvas:
  """Left-pads prompts to a shared (bucketed) length so every row's generation
  region starts at the same column; suffixes follow it, right-padded."""
  if gen_len < 1:
    raise ValueError(f"the number of tokens to generate must be >= 1, got {gen_len}")
  b = len(prompts)
  if b == 0:
    raise ValueError("no prompts given")
  suffixes = suffixes if suffixes is not None else [[] for _ in range(b)]
  if len(suffixes) != b:
    raise ValueError(f"{len(suffixes)} suffixes for {b} prompts")
  p_len = bucket(max(len(p) for p in prompts), multiple)
  s_len = max(len(s) for s in suffixes)
  total = bucket(p_len + gen_len + s_len, multiple)
  tokens = np.full((b, total), pad_id, np.int32)
  valid = np.zeros((b, total), bool)
  for i, (p, s) in enumerate(zip(prompts, suffixes)):
    tokens[i, p_len - len(p):p_len] = p
    valid[i, p_len - len(p):p_len] = True
    tokens[i, p_len:p_len + gen_len] = mask_id
    valid[i, p_len:p_len + gen_len] = True
    tokens[i, p_len + gen_len:p_len + gen_len + len(s)] = s
    valid[i, p_len + gen_len:p_len + gen_len + len(s)] = True
  fixed = np.ones((b, total), bool)
  fixed[:, p_len:p_len + gen_len] = False
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
  return Canvas(tokens, valid, fixed, positions, p_len, gen_len)
