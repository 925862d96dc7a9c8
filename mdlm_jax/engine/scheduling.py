"""What the engine decides each turn, as pure functions of counts: how many
slots a pass covers, which prompt bucket a prefill pads to, which admits
share a prefill, and whether a pass carries the finished blocks."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pass_size(busy: int, min_rows: int, num_slots: int) -> int:
  """The pass size for slots [0, busy) busy: `min_rows` (the mesh's batch
  shards) times 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and halfway
  between): few compiles, and on a device where a pass costs its rows (a
  CPU), at most a quarter of a pass past two rows spent on idle slots (six
  busy slots ran in passes of eight with powers of two alone)."""
  k = 1
  while min_rows * k < busy:
    k = 2 if k == 1 else (k * 3 // 2 if k & (k - 1) == 0 else k // 3 * 4)
  return min(min_rows * k, num_slots)


def ride_with_head(waiting: np.ndarray, waited: bool) -> tuple[bool, bool]:
  """Whether the next pass carries the finished blocks, given which busy slots
  have one `waiting` and whether one `waited` through the last pass: when at
  least half wait, or one already waited. Otherwise the others refine in a
  pass half as long, and the waiting ones catch up with the next. Returns
  (with the blocks, whether one waits through this pass)."""
  n = int(np.sum(waiting))
  with_head = n > 0 and (2 * n >= len(waiting) or waited)
  return with_head, n > 0 and not with_head


def prompt_bucket(n: int, cap: int) -> int:
  """Prompt lengths are padded to 16, 24, 32, 48, 64, 96, ... (powers of two
  and halfway between): few compiles, and at most a third of a prefill is
  padding (a 65-token prompt padded to 128 cost 9.8 ms a prefill, to 96 7.3)."""
  b = 16
  while b < n:
    b = b * 3 // 2 if b & (b - 1) == 0 else b // 3 * 4
  return min(b, cap)


ADMIT_TOKENS = 512  # the most token rows one batched prefill holds
MIN_PREFILL_CHUNK = 16  # the smallest prompt bucket


def admit_sizes(bucket: int, admit_batch: int) -> list[int]:
  """The prefill batch sizes compiled for a prompt bucket: powers of two up
  to `admit_batch` and ADMIT_TOKENS // bucket (past a few hundred tokens a
  prefill costs its tokens, and batching saves nothing)."""
  cap = max(1, min(admit_batch, ADMIT_TOKENS // bucket))
  return [1 << i for i in range(cap.bit_length())]


def admit_groups(buckets: Sequence[int], admit_batch: int) -> list[tuple[int, list[int]]]:
  """(bucket, indices) of the prefills for admits with these prompt buckets:
  longest first, each batch padded to its longest member's bucket and taking
  only prompts at least half as long (padding stays under a prompt's own
  length), its size one of `admit_sizes`."""
  order = sorted(range(len(buckets)), key=lambda i: -buckets[i])
  groups = []
  while order:
    bucket = buckets[order[0]]
    fits = sum(2 * buckets[i] >= bucket for i in order)
    k = max(n for n in admit_sizes(bucket, admit_batch) if n <= fits)
    groups.append((bucket, order[:k]))
    order = order[k:]
  return groups


__all__ = ["ADMIT_TOKENS", "MIN_PREFILL_CHUNK", "admit_groups", "admit_sizes", "pass_size", "prompt_bucket",
           "ride_with_head"]
