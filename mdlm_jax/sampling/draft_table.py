"""Drafts from a table of how a model's own answers go on (retrieval drafts).

A chat model's answers repeat their phrasing across requests ("Here is a
Python function that", "```python\\ndef", "This function uses the"), and
that phrasing is exactly what neither the masked block (three drafts, often
unsure) nor copying from the prompt offers. The table maps each context of
up to `order` tokens seen in answers the base wrote itself (self-distilled
data) to the token that most often followed it, and answers from the longest
context it knows (backing off to shorter ones, down to `min_context`
tokens); a revising pass chains it from the text's last tokens into drafts.
The base verifies them like any draft (`rule.verify`), so the text stays the
base's: the table sets only the speed.

    python -m mdlm_jax.sampling.draft_table --checkpoint=DIR --answers=a.jsonl[,b.jsonl] --out=DIR/draft_table.npz

The table is a trie of contexts read backwards: nodes 0 to vocab - 1 are the
one-token contexts (the last token), and a node's children, a contiguous
range sorted by token, extend its context by the token before it. Contexts
whose follower is their parent's, with nothing below them, are left out (they
would answer the same), so a kept node's parent is kept too.

On the device a lookup does not walk the trie: a binary search a level is a
chain of dependent gathers, each a separate operation (on XLA:CPU about 250
of them a six-column pass, a millisecond). Instead every node below the
tokens' level sits in a hash bucket of its whole context, so the candidates
of every level are gathered at once from the query's hashes, and a node
matches when its token and its parent are the query's (by induction up the
levels the match is exact, whatever collides). The follower of the deepest
matching node with one answers.
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
from jaxtyping import Array, Bool, Float, Int

FILE_NAME = "draft_table.npz"  # beside a model's weights: loading picks it up
ORDER = 4  # the longest context a built table keeps, in tokens
MIN_CONTEXT = 1  # the shortest context that answers: a weak guess still beats an empty column, which is as costly
SHARE_STEPS = 16  # a follower's share of its context's occurrences is kept in these steps
NODES_PER_BUCKET = 2  # the hash index's mean load: buckets are the power of two that keeps it at most this
_SEED, _MUL, _FINAL = 0x2545F491, 0x9E3779B1, 0x85EBCA77  # the context hash (uint32 arithmetic, wrapping)


@struct.dataclass
class DraftTable:
  children: Int[Array, "n1"]  # node n's children are nodes children[n]:children[n + 1]
  key: Int[Array, "n"]  # each node's token: the one its context adds before its parent's
  follow: Int[Array, "n"]  # the token that most often followed the node's context (-1: none kept)
  share: Int[Array, "n"]  # how often it did, in SHARE_STEPS-ths of the context's occurrences
  parent: Int[Array, "n"]  # each node's parent (-1 on the tokens' level)
  bucket_start: Int[Array, "nb1"]  # the nodes hashed to bucket h are bucket_node[bucket_start[h]:bucket_start[h + 1]]
  bucket_node: Int[Array, "m"]  # nodes below the tokens' level by bucket, then `probe` padding entries
  vocab_size: int = struct.field(pytree_node=False)
  order: int = struct.field(pytree_node=False)  # the longest context the table knows, in tokens
  bucket_bits: int = struct.field(pytree_node=False)  # log2 of the number of buckets
  probe: int = struct.field(pytree_node=False)  # the fullest bucket's nodes: how many a lookup reads a level

  @property
  def entries(self) -> int:
    """Contexts that answer (nodes with a follower)."""
    return int(np.sum(np.asarray(self.follow) >= 0))

  def next_token(self, context: Int[Array, "b k"], known: Bool[Array, "b k"]) -> tuple[Bool[Array, "b"],
                                                                                       Int[Array, "b"]]:
    """(found, the token that most often followed the longest known suffix of
    `context`) per row. `context` holds the text's last k tokens, oldest
    first; `known` marks those that are text (a context stops at the first
    unknown token, counting back)."""
    found, token, _ = self.lookup(context, known)
    return found, token

  def lookup(self, context: Int[Array, "b k"], known: Bool[Array, "b k"]) -> tuple[Bool[Array, "b"], Int[Array, "b"],
                                                                                  Float[Array, "b"]]:
    """`next_token`, and the chance that token follows: its share of the
    context's occurrences in the answers the table was built from."""
    v, n = self.vocab_size, int(self.key.shape[0])
    b, k = context.shape
    levels = min(self.order, k)
    back = context[:, ::-1][:, :levels]  # the last token first
    usable = known[:, ::-1][:, :levels] & (back >= 0) & (back < v)
    usable = jnp.cumsum(~usable, axis=1) == 0  # a context stops at its first unusable token, counting back
    node = jnp.clip(back[:, 0], 0, v - 1)
    best = jnp.where(usable[:, 0], self.follow[node], -1)
    share = self.share[node]
    if levels > 1:
      raw = _rolling_hash(jnp.clip(back, 0, v - 1).astype(jnp.uint32), jnp)  # [b, levels]
      start = self.bucket_start[_bucket(raw[:, 1:], self.bucket_bits, jnp).astype(jnp.int32)]
      cand = self.bucket_node[jnp.minimum(start[..., None] + jnp.arange(self.probe), self.bucket_node.shape[0] - 1)]
      cand_key, cand_parent = self.key[cand], self.parent[cand]  # [b, levels - 1, probe]
      alive = usable[:, 0]
      for level in range(2, levels + 1):
        i = level - 2
        hit = (cand_key[:, i] == back[:, level - 1, None]) & (cand_parent[:, i] == node[:, None])
        at = jnp.max(jnp.where(hit, cand[:, i], -1), axis=1)
        alive = alive & usable[:, level - 1] & (at >= 0)
        at = jnp.clip(at, 0, n - 1)
        node = jnp.where(alive, at, node)
        deeper = alive & (self.follow[at] >= 0)
        best = jnp.where(deeper, self.follow[at], best)
        share = jnp.where(deeper, self.share[at], share)
    return best >= 0, jnp.maximum(best, 0), jnp.where(best >= 0, share, 0).astype(jnp.float32) / SHARE_STEPS

  def extend(self, context: Int[Array, "b k"], context_known: Bool[Array, "b k"], ahead: Int[Array, "b h"],
             n_ahead: Int[Array, "b"], floor=0.0) -> tuple[Int[Array, "b h"], Int[Array, "b"]]:
    """A revising head `ahead` (the base's next token, then `n_ahead`
    drafts; `context` the text's tokens before it, `context_before`) with its
    free columns filled by the table's chain from its last tokens: the
    model's or copied drafts, then how answers went on from there. The chain
    stops where the product of its tokens' shares (its chance of holding this
    far) falls below `floor` ([b] array or scalar): a draft that will likely
    fail is not worth a column where a pass costs its rows."""
    b, h = ahead.shape
    k = context.shape[1]
    n = jnp.maximum(n_ahead, 0)
    ext = jnp.concatenate([context, ahead], 1)
    ext_known = jnp.concatenate([context_known, jnp.ones((b, h), bool)], 1)
    window = n[:, None] + jnp.arange(k + 1)[None]  # the k + 1 tokens that end at the head's last
    ctx = jnp.take_along_axis(ext, window, 1)
    ctx_known = jnp.take_along_axis(ext_known, window, 1)
    alive = n_ahead >= 0
    chance = jnp.ones((b,), jnp.float32)
    floor = jnp.asarray(floor, jnp.float32)
    out, count = ahead, n
    for i in range(h - 1):
      found, c, share = self.lookup(ctx, ctx_known)
      chance = chance * share
      col = n + 1 + i
      alive = alive & found & (col < h) & (chance >= floor)
      out = jnp.where(alive[:, None] & (jnp.arange(h)[None] == col[:, None]), c[:, None], out)
      count = count + alive.astype(jnp.int32)
      ctx = jnp.concatenate([ctx[:, 1:], c[:, None]], 1)
      ctx_known = jnp.concatenate([ctx_known[:, 1:], jnp.ones((b, 1), bool)], 1)
    return out, jnp.where(n_ahead < 0, n_ahead, count)


def context_before(table: DraftTable, text: Int[Array, "b l"], known: Bool[Array, "b l"],
                   end: Int[Array, "b"]) -> tuple[Int[Array, "b k"], Bool[Array, "b k"]]:
  """The `table.order - 1` tokens of `text` before column `end` (the head's
  first token) and which of them are known text: `extend`'s context."""
  k = table.order - 1
  at = end[:, None] - k + jnp.arange(k)[None]
  inside = at >= 0
  at = jnp.clip(at, 0, text.shape[1] - 1)
  return jnp.take_along_axis(text, at, 1), inside & jnp.take_along_axis(known, at, 1)


def _rolling_hash(back, xp):
  """[..., j]: the raw hash of the context of the last j + 1 tokens, `back`
  (uint32, the last token first); numpy and jax.numpy alike, so that the
  index built on the host is the one the device reads."""
  h, out = xp.uint32(_SEED), []
  for j in range(back.shape[-1]):
    h = (h ^ back[..., j]) * xp.uint32(_MUL)
    out.append(h)
  return xp.stack(out, axis=-1)


def _bucket(raw, bits: int, xp):
  """The bucket of a raw context hash: its mixed top `bits` bits."""
  h = raw ^ (raw >> xp.uint32(16))
  h = h * xp.uint32(_FINAL)
  h = h ^ (h >> xp.uint32(13))
  return h >> xp.uint32(32 - bits) if bits else xp.zeros_like(h)


def _most_frequent(ids: np.ndarray, follower: np.ndarray, n: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """Per id in [0, n): (its most frequent follower, smallest on a tie, or -1;
  that follower's share of the id's occurrences in SHARE_STEPS-ths, rounded)."""
  keys, counts = np.unique(ids * vocab_size + follower, return_counts=True)
  which, nxt = keys // vocab_size, keys % vocab_size
  order = np.lexsort((nxt, -counts, which))
  which, nxt, counts = which[order], nxt[order], counts[order]
  first = np.ones(which.shape, bool)
  first[1:] = which[1:] != which[:-1]
  follow = np.full(n, -1, np.int64)
  follow[which[first]] = nxt[first]
  share = np.zeros(n, np.int64)
  total = np.bincount(ids, minlength=n)
  share[which[first]] = np.rint(SHARE_STEPS * counts[first] / total[which[first]])
  return follow, share


def build(sequences: Iterable[Sequence[int]], vocab_size: int, order: int = ORDER,
          min_context: int = MIN_CONTEXT) -> DraftTable:
  """The table of `sequences` (token ids): every context of `min_context` to
  `order` tokens seen followed by something maps to its most frequent
  follower (the smallest id on a tie)."""
  if vocab_size < 1 or vocab_size >= 2 ** 24:
    raise ValueError(f"vocab_size must be in [1, 2**24), got {vocab_size}")
  if not 1 <= min_context <= order:
    raise ValueError(f"need 1 <= min_context <= order, got min_context={min_context}, order={order}")
  pieces = [np.full(order, -1, np.int64)]  # -1 before and between sequences: no context spans two
  for seq in sequences:
    s = np.asarray(seq, np.int64).reshape(-1)
    if s.size and (s.min() < 0 or s.max() >= vocab_size):
      raise ValueError(f"a sequence holds ids outside [0, {vocab_size})")
    pieces += [s, np.full(1, -1, np.int64)]
  flat = np.concatenate(pieces)
  pos = np.flatnonzero((flat[:-1] >= 0) & (flat[1:] >= 0))  # a context ends here and a token follows
  nxt = flat[pos + 1]
  node = flat[pos]  # level 1: a node per token, its id the token
  follow, share = _most_frequent(node, nxt, vocab_size, vocab_size)
  first = min_context <= 1
  levels = [(np.full(vocab_size, -1), np.arange(vocab_size), np.where(first, follow, -1), np.where(first, share, 0))]
  start = vocab_size  # the first id of the next level
  for level in range(2, order + 1):
    token = flat[pos - level + 1]
    keep = token >= 0
    pos, nxt, node, token = pos[keep], nxt[keep], node[keep], token[keep]
    keys, local = np.unique(node * vocab_size + token, return_inverse=True)  # sorted by parent, then token
    local = local.reshape(-1)
    follow, share = _most_frequent(local, nxt, len(keys), vocab_size)
    answers = level >= min_context
    levels.append((keys // vocab_size, keys % vocab_size, follow if answers else np.full_like(follow, -1),
                   share if answers else np.zeros_like(share)))
    node = start + local
    start += len(keys)
  return _assemble(_pruned(levels, vocab_size), vocab_size)


def _pruned(levels: list, vocab_size: int) -> list:
  """`levels` ((parent, key, follow, share) a level, parents as global node
  ids) without the nodes that answer as their parent does (the same follower
  and share) and have nothing kept below them (a lookup then stops at the
  parent, whose answer is the same); parents renumbered to match. The
  tokens' level stays whole."""
  starts = np.cumsum([0] + [len(lv[1]) for lv in levels])
  said = [levels[0][2:4]]  # what a lookup that ends at each node answers: (follower, share)
  for i in range(1, len(levels)):
    parent, _, follow, share = levels[i]
    up = parent - starts[i - 1]
    own = follow >= 0
    said.append((np.where(own, follow, said[i - 1][0][up]), np.where(own, share, said[i - 1][1][up])))
  keep = [None] * len(levels)
  keep[0] = np.ones(vocab_size, bool)
  for i in range(len(levels) - 1, 0, -1):
    parent, _, follow, share = levels[i]
    up = parent - starts[i - 1]
    has_child = np.zeros(len(follow), bool)
    if i + 1 < len(levels):
      has_child[levels[i + 1][0][keep[i + 1]] - starts[i]] = True
    differs = (follow != said[i - 1][0][up]) | (share != said[i - 1][1][up])
    keep[i] = has_child | ((follow >= 0) & differs)
  out, new_id, start = [], None, 0
  for i, (parent, key, follow, share) in enumerate(levels):
    k = keep[i]
    out.append((new_id[parent[k] - starts[i - 1]] if i else parent, key[k], follow[k], share[k]))
    new_id = start + np.cumsum(k) - 1
    start += int(k.sum())
  return out


def _assemble(levels: list, vocab_size: int) -> DraftTable:
  """The device table of `levels` (the tokens' level first)."""
  parents = np.concatenate([lv[0] for lv in levels[1:]]) if len(levels) > 1 else np.zeros(0, np.int64)
  key, follow, share = (np.concatenate([lv[i] for lv in levels]) for i in (1, 2, 3))
  children = vocab_size + np.searchsorted(parents, np.arange(len(key) + 1))
  return _table(children, key, follow, share, vocab_size, len(levels))


def _table(children, key, follow, share, vocab_size: int, order: int,
           nodes_per_bucket: float = NODES_PER_BUCKET) -> DraftTable:
  """Checked arrays as a device table, with the hash index of its contexts."""
  children, key, follow, share = (np.asarray(x, np.int64).reshape(-1) for x in (children, key, follow, share))
  n = len(key)
  if (len(children) != n + 1 or follow.shape != key.shape or share.shape != key.shape or not 1 <= vocab_size <= n
          or order < 1 or np.any(children[:-1] > children[1:]) or children[0] != vocab_size or children[-1] != n
          or np.any(key < 0) or np.any(key >= vocab_size) or np.any(follow < -1) or np.any(follow >= vocab_size)
          or np.any(share < 0) or np.any(share > SHARE_STEPS)):
    raise ValueError(f"not a draft table over {vocab_size} tokens: its children do not index its {n} nodes"
                     " or its tokens or shares are out of range")
  parent = np.searchsorted(children, np.arange(n), side="right") - 1  # children[p] <= node < children[p + 1]
  parent[:vocab_size] = -1
  level = np.ones(n, np.int64)
  raw = np.zeros(n, np.uint32)
  raw[:vocab_size] = _rolling_hash(np.arange(vocab_size, dtype=np.uint32)[:, None], np)[:, 0]
  done = vocab_size
  while done < n:  # a level's nodes are the children of the level before, so parents come first
    upto = int(children[done])
    if upto <= done or level[parent[done]] + 1 > order:
      raise ValueError(f"not a draft table over {vocab_size} tokens: its trie is deeper than its order {order}")
    span = slice(done, upto)
    level[span] = level[parent[span]] + 1
    raw[span] = (raw[parent[span]] ^ key[span].astype(np.uint32)) * np.uint32(_MUL)
    done = upto
  below = n - vocab_size
  bits = max(0, int(np.ceil(np.log2(max(below / nodes_per_bucket, 1)))))
  bucket = _bucket(raw[vocab_size:], bits, np).astype(np.int64)
  by_bucket = vocab_size + np.argsort(bucket, kind="stable")
  bucket_start = np.searchsorted(np.sort(bucket), np.arange((1 << bits) + 1))
  probe = int(np.diff(bucket_start).max(initial=0)) if below else 0
  bucket_node = np.concatenate([by_bucket, np.zeros(max(probe, 1), np.int64)])  # padding: node 0 never matches
  i32 = lambda x: jnp.asarray(np.asarray(x).astype(np.int32))  # noqa: E731
  return DraftTable(children=i32(children), key=i32(key), follow=i32(follow), share=i32(share), parent=i32(parent),
                    bucket_start=i32(bucket_start), bucket_node=i32(bucket_node), vocab_size=vocab_size,
                    order=order, bucket_bits=bits, probe=max(probe, 1))


def save(table: DraftTable, path: str) -> None:
  """Written whole or not at all (a temporary file renamed into place)."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    np.savez_compressed(f, children=np.asarray(table.children), key=np.asarray(table.key),
                        follow=np.asarray(table.follow), share=np.asarray(table.share).astype(np.uint8),
                        vocab_size=table.vocab_size, order=table.order)
  os.replace(tmp, path)


def load(path: str, vocab_size: int | None = None) -> DraftTable:
  """A saved table; one in the first format (token pairs: offsets, second,
  follow) becomes the trie of those pairs. A table saved without shares
  holds its chains as sure (they never stop at a floor)."""
  with np.load(path) as z:
    arrays = {k: np.asarray(z[k]) for k in z.files}
  if "offsets" in arrays:
    table = _of_pairs(path, arrays)
  elif {"children", "key", "follow", "vocab_size", "order"} <= set(arrays):
    try:
      share = arrays.get("share", np.where(arrays["follow"] >= 0, SHARE_STEPS, 0))
      table = _table(arrays["children"], arrays["key"], arrays["follow"], share, int(arrays["vocab_size"]),
                     int(arrays["order"]))
    except ValueError as e:
      raise ValueError(f"{path} is {e}") from None
  else:
    raise ValueError(f"{path} is not a draft table: it holds {sorted(arrays)}")
  if vocab_size is not None and table.vocab_size != vocab_size:
    raise ValueError(f"{path} is a draft table for a vocabulary of {table.vocab_size} tokens; the model has"
                     f" {vocab_size}")
  return table


def _of_pairs(path: str, z: dict) -> DraftTable:
  """The first format: for each first token a range (`offsets`) of second tokens and their followers."""
  offsets, second, follow = (np.asarray(z.get(k, np.zeros(0)), np.int64) for k in ("offsets", "second", "follow"))
  n = len(second)
  if (offsets.ndim != 1 or len(offsets) < 2 or follow.shape != second.shape or offsets[0] != 0
          or offsets[-1] != n or np.any(np.diff(offsets) < 0)):
    raise ValueError(f"{path} is not a draft table: its offsets do not index its {n} entries")
  v = len(offsets) - 1
  first = np.repeat(np.arange(v), np.diff(offsets))
  order = np.lexsort((first, second))  # read backwards: the second token, then the first
  levels = [(np.full(v, -1), np.arange(v), np.full(v, -1), np.zeros(v)),
            (second[order], first[order], follow[order], np.full(n, SHARE_STEPS))]
  return _assemble(levels, v)


def answers_of(path: str) -> list[str]:
  """The model's own text in a jsonl of `python -m mdlm_jax.distill` (.gz
  read as such): the assistant turns of its chat records, and each
  continuation record's window and continuation as one text (the
  continuation follows on from the window's last tokens)."""
  opener = gzip.open if path.endswith(".gz") else open
  out = []
  with opener(path, "rt", encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        if isinstance(record, dict) and isinstance(record.get("completion"), str):
          out.append(record["prompt"] + record["completion"])
          continue
        messages = record["messages"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}:{n}: not a chat record with 'messages' nor a continuation with 'prompt' and"
                         f" 'completion' ({e})") from None
      out += [m["content"] for m in messages if m.get("role") == "assistant" and isinstance(m.get("content"), str)]
  return out


def _weights(spec: str, files: int) -> list[int]:
  """--weights: one whole number >= 1 for each of `files` files (empty: 1 each)."""
  if not spec.strip():
    return [1] * files
  try:
    weights = [int(w) for w in spec.split(",")]
  except ValueError:
    raise ValueError(f"--weights must be comma-separated whole numbers, got {spec!r}") from None
  if len(weights) != files or min(weights) < 1:
    raise ValueError(f"--weights needs a number >= 1 for each of the {files} --answers files, got {spec!r}")
  return weights


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m mdlm_jax.sampling.draft_table", description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint", required=True, help="the model whose tokenizer encodes the answers")
  p.add_argument("--answers", required=True,
                 help="comma-separated jsonl files of `distill` (.gz too): chat records' assistant turns, code"
                      " continuations' windows and continuations")
  p.add_argument("--weights", default="",
                 help="comma-separated whole numbers, one for each --answers file: how many times its texts count"
                      " (default: once each)")
  p.add_argument("--out", required=True, help=f"the table's file (a model folder's {FILE_NAME} is loaded with it)")
  p.add_argument("--order", type=int, default=ORDER, help="the longest context kept, in tokens")
  p.add_argument("--min-context", type=int, default=MIN_CONTEXT, help="the shortest context that answers")
  a = p.parse_args(argv)
  from mdlm_jax import checkpoints, cli
  try:
    loaded = checkpoints.load(a.checkpoint)
    paths = [path.strip() for path in a.answers.split(",") if path.strip()]
    weights = _weights(a.weights, len(paths))
    texts = [t for path, w in zip(paths, weights) for t in answers_of(path) * w]
    if not texts:
      raise ValueError(f"no assistant turns or continuations in {a.answers}")
    table = build((loaded.tokenizer.encode(t) for t in texts), loaded.spec.cfg.vocab_size, a.order, a.min_context)
    save(table, a.out)
  except cli.USER_ERRORS as e:
    cli.fail("draft_table", e)
  print(f"{a.out}: {table.entries} contexts of {a.min_context} to {table.order} tokens from {len(texts)} texts",
        file=sys.stderr)


if __name__ == "__main__":
  main()
