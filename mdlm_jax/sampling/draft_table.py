"""Drafts from a table of how a model's own answers go on (retrieval drafts).

A chat model's answers repeat their phrasing across requests ("Here is a
Python function that", "```python\\ndef", "This function uses the"), and
that phrasing is exactly what neither the masked block (three drafts, often
unsure) nor copying from the prompt offers. The table maps each pair of
tokens seen in answers the base wrote itself (self-distilled data) to the
token that most often followed it; a revising pass chains it from the text's
last two tokens into drafts. The base verifies them like any draft
(`rule.verify`), so the text stays the base's: the table sets only the speed.

    python -m mdlm_jax.sampling.draft_table --checkpoint=DIR --answers=a.jsonl[,b.jsonl] --out=DIR/draft_table.npz

On the device the table is three arrays: for each first token a range
(`offsets`) of second tokens (sorted) and what follows each pair; a lookup
is a binary search of fixed depth, so a chain of drafts is a few gathers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from typing import Iterable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

FILE_NAME = "draft_table.npz"  # beside a model's weights: loading picks it up


@struct.dataclass
class DraftTable:
  offsets: Int[Array, "v1"]  # pairs starting with token a are entries offsets[a]:offsets[a + 1]
  second: Int[Array, "k"]  # each entry's second token, ascending within its first token's range
  follow: Int[Array, "k"]  # the token that most often followed the pair
  depth: int = struct.field(pytree_node=False)  # binary-search steps that cover the widest range

  @property
  def vocab_size(self) -> int:
    return int(self.offsets.shape[0]) - 1

  @property
  def entries(self) -> int:
    return int(self.second.shape[0])

  def next_token(self, a: Int[Array, "b"], b: Int[Array, "b"]) -> tuple[Bool[Array, "b"], Int[Array, "b"]]:
    """(found, the token that followed (a, b) most often) per row."""
    if not self.entries:  # nothing to gather from
      return jnp.zeros(a.shape, bool), jnp.zeros(a.shape, jnp.int32)
    v = self.vocab_size
    ok = (a >= 0) & (a < v) & (b >= 0)
    a = jnp.clip(a, 0, v - 1)
    lo, end = self.offsets[a], self.offsets[a + 1]
    hi = end
    last = self.entries - 1
    for _ in range(self.depth):  # the first entry of the range whose second token is >= b
      mid = (lo + hi) // 2
      open_ = lo < hi
      right = self.second[jnp.minimum(mid, last)] < b
      lo = jnp.where(open_ & right, mid + 1, lo)
      hi = jnp.where(open_ & ~right, mid, hi)
    at = jnp.minimum(lo, last)
    found = ok & (lo < end) & (self.second[at] == b)
    return found, jnp.where(found, self.follow[at], 0)

  def extend(self, prev: Int[Array, "b"], prev_known: Bool[Array, "b"], ahead: Int[Array, "b h"],
             n_ahead: Int[Array, "b"]) -> tuple[Int[Array, "b h"], Int[Array, "b"]]:
    """A revising head `ahead` (the base's next token, then `n_ahead`
    drafts; `prev` the text's token before it) with its free columns filled
    by the table's chain from its last two tokens: the model's or copied
    drafts, then how answers went on from there."""
    h = ahead.shape[1]
    n = jnp.maximum(n_ahead, 0)
    ext = jnp.concatenate([prev[:, None], ahead], 1)
    take = lambda i: jnp.take_along_axis(ext, i[:, None], 1)[:, 0]  # noqa: E731
    x, y = take(n), take(n + 1)
    alive = (n_ahead >= 0) & ((n > 0) | prev_known)
    out, count = ahead, n
    for i in range(h - 1):
      found, c = self.next_token(x, y)
      col = n + 1 + i
      alive = alive & found & (col < h)
      out = jnp.where(alive[:, None] & (jnp.arange(h)[None] == col[:, None]), c[:, None], out)
      count = count + alive.astype(jnp.int32)
      x, y = y, c
    return out, jnp.where(n_ahead < 0, n_ahead, count)


def build(sequences: Iterable[Sequence[int]], vocab_size: int) -> DraftTable:
  """The table of `sequences` (token ids): each pair (a, b) seen followed by
  something maps to its most frequent follower (the smallest id on a tie)."""
  if vocab_size < 1 or vocab_size >= 2 ** 21:  # a triple's key must fit in int64
    raise ValueError(f"vocab_size must be in [1, 2**21), got {vocab_size}")
  parts = []
  for seq in sequences:
    s = np.asarray(seq, np.int64)
    if s.size and (s.min() < 0 or s.max() >= vocab_size):
      raise ValueError(f"a sequence holds ids outside [0, {vocab_size})")
    if s.size >= 3:
      parts.append((s[:-2] * vocab_size + s[1:-1]) * vocab_size + s[2:])
  keys, counts = np.unique(np.concatenate(parts) if parts else np.zeros((0,), np.int64), return_counts=True)
  pair, nxt = keys // vocab_size, keys % vocab_size
  # Within each pair: the largest count first, then the smallest follower.
  order = np.lexsort((nxt, -counts, pair))
  pair, nxt = pair[order], nxt[order]
  first = np.ones(pair.shape, bool)
  first[1:] = pair[1:] != pair[:-1]
  pair, nxt = pair[first], nxt[first]
  a, b = pair // vocab_size, pair % vocab_size
  offsets = np.searchsorted(a, np.arange(vocab_size + 1)).astype(np.int32)
  widest = int(np.max(np.diff(offsets))) if len(a) else 0
  return DraftTable(offsets=jnp.asarray(offsets), second=jnp.asarray(b.astype(np.int32)),
                    follow=jnp.asarray(nxt.astype(np.int32)), depth=max(int(widest).bit_length(), 1))


def save(table: DraftTable, path: str) -> None:
  """Written whole or not at all (a temporary file renamed into place)."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    np.savez_compressed(f, offsets=np.asarray(table.offsets), second=np.asarray(table.second),
                        follow=np.asarray(table.follow))
  os.replace(tmp, path)


def load(path: str, vocab_size: int | None = None) -> DraftTable:
  with np.load(path) as z:
    offsets, second, follow = (np.asarray(z[k], np.int32) for k in ("offsets", "second", "follow"))
  n = len(second)
  if (offsets.ndim != 1 or len(offsets) < 2 or follow.shape != second.shape or offsets[0] != 0
          or offsets[-1] != n or np.any(np.diff(offsets) < 0)):
    raise ValueError(f"{path} is not a draft table: its offsets do not index its {n} entries")
  if vocab_size is not None and len(offsets) - 1 != vocab_size:
    raise ValueError(f"{path} is a draft table for a vocabulary of {len(offsets) - 1} tokens; the model has"
                     f" {vocab_size}")
  widest = int(np.max(np.diff(offsets)))
  return DraftTable(offsets=jnp.asarray(offsets), second=jnp.asarray(second), follow=jnp.asarray(follow),
                    depth=max(widest.bit_length(), 1))


def answers_of(path: str) -> list[str]:
  """The assistant turns of a chat jsonl (`python -m mdlm_jax.distill`'s
  output; .gz read as such)."""
  opener = gzip.open if path.endswith(".gz") else open
  out = []
  with opener(path, "rt", encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        messages = json.loads(line)["messages"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:{n}: not a chat record with 'messages' ({e})") from None
      out += [m["content"] for m in messages if m.get("role") == "assistant" and isinstance(m.get("content"), str)]
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.sampling.draft_table", description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint", required=True, help="the model whose tokenizer encodes the answers")
  p.add_argument("--answers", required=True, help="comma-separated chat jsonl files (.gz too): their assistant turns")
  p.add_argument("--out", required=True, help=f"the table's file (a model folder's {FILE_NAME} is loaded with it)")
  a = p.parse_args(argv)
  from mdlm_jax import checkpoints, cli
  try:
    loaded = checkpoints.load(a.checkpoint)
    texts = [t for path in a.answers.split(",") if path.strip() for t in answers_of(path.strip())]
    if not texts:
      raise ValueError(f"no assistant turns in {a.answers}")
    table = build((loaded.tokenizer.encode(t) for t in texts), loaded.spec.cfg.vocab_size)
    save(table, a.out)
  except cli.USER_ERRORS as e:
    cli.fail("draft_table", e)
  print(f"{a.out}: {table.entries} pairs from {len(texts)} answers", file=sys.stderr)


if __name__ == "__main__":
  main()
