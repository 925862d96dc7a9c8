"""Drafts from a table of answers (`sampling.draft_table`) against a dictionary built by hand."""

import collections
import json

import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.sampling import draft_table


def _reference(seqs):
  """(a, b) -> the most frequent follower, the smallest id on a tie."""
  counts = collections.defaultdict(collections.Counter)
  for s in seqs:
    for a, b, c in zip(s, s[1:], s[2:]):
      counts[(a, b)][c] += 1
  return {k: min(c, key=lambda t: (-c[t], t)) for k, c in counts.items()}


def _random_seqs(rng, vocab, n=40):
  # A small vocabulary: most pairs recur with several followers, so ties and counts matter.
  return [rng.integers(0, vocab, rng.integers(0, 30)).tolist() for _ in range(n)]


def test_each_pair_maps_to_its_most_frequent_follower():
  rng = np.random.default_rng()
  vocab = 7
  seqs = _random_seqs(rng, vocab)
  table, ref = draft_table.build(seqs, vocab), _reference(seqs)
  assert table.entries == len(ref)
  a, b = (x.ravel() for x in np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij"))
  found, follow = table.next_token(jnp.asarray(a), jnp.asarray(b))
  for i, pair in enumerate(zip(a.tolist(), b.tolist())):
    assert bool(found[i]) == (pair in ref), pair
    if pair in ref:
      assert int(follow[i]) == ref[pair], pair


def test_a_wide_vocabulary_finds_pairs_in_long_ranges():
  rng = np.random.default_rng()
  vocab = 5000
  # One first token followed by many seconds: the binary search's depth is exercised.
  seqs = [[3, int(b), int(c)] for b, c in zip(rng.integers(0, vocab, 600), rng.integers(0, vocab, 600))]
  table, ref = draft_table.build(seqs, vocab), _reference(seqs)
  probe = list(ref) + [(3, int(x)) for x in rng.integers(0, vocab, 200)] + [(4, 1), (vocab - 1, 0)]
  found, follow = table.next_token(jnp.asarray([p[0] for p in probe]), jnp.asarray([p[1] for p in probe]))
  for i, pair in enumerate(probe):
    assert bool(found[i]) == (pair in ref)
    if pair in ref:
      assert int(follow[i]) == ref[pair]


def _extended(ref, prev, prev_known, ahead, n):
  """The head with its free columns chained from its last two tokens, in plain Python."""
  if n < 0 or (n == 0 and not prev_known):
    return list(ahead), n
  seq = [prev] + list(ahead[:n + 1])
  a, b, out = seq[-2], seq[-1], list(ahead[:n + 1])
  while len(out) < len(ahead) and (a, b) in ref:
    out.append(ref[(a, b)])
    a, b = b, out[-1]
  return out + list(ahead[len(out):]), len(out) - 1


def test_a_head_is_extended_by_the_chain_from_its_last_two_tokens():
  rng = np.random.default_rng()
  vocab, b, h = 5, 64, 5
  seqs = _random_seqs(rng, vocab, 30)
  table, ref = draft_table.build(seqs, vocab), _reference(seqs)
  ahead = rng.integers(0, vocab, (b, h))
  n = rng.integers(-1, h, b)
  prev, prev_known = rng.integers(0, vocab, b), rng.random(b) > 0.2
  out, count = table.extend(jnp.asarray(prev), jnp.asarray(prev_known), jnp.asarray(ahead), jnp.asarray(n))
  grew = 0
  for r in range(b):
    want, c = _extended(ref, int(prev[r]), bool(prev_known[r]), ahead[r].tolist(), int(n[r]))
    assert int(count[r]) == c, r
    np.testing.assert_array_equal(np.asarray(out[r, :c + 1]), want[:c + 1])
    grew += c > n[r]
  assert grew > 0


def test_an_empty_table_extends_nothing():
  table = draft_table.build([[1, 2]], 4)
  out, count = table.extend(jnp.array([1]), jnp.array([True]), jnp.array([[2, 3, 0]]), jnp.array([0]))
  assert table.entries == 0 and int(count[0]) == 0 and np.asarray(out).tolist() == [[2, 3, 0]]


def test_saved_tables_load_and_bad_ones_are_named(tmp_path):
  rng = np.random.default_rng()
  seqs = _random_seqs(rng, 9)
  table = draft_table.build(seqs, 9)
  path = str(tmp_path / "t.npz")
  draft_table.save(table, path)
  back = draft_table.load(path, vocab_size=9)
  for name in ("offsets", "second", "follow"):
    np.testing.assert_array_equal(getattr(back, name), getattr(table, name))
  assert back.depth == table.depth
  with pytest.raises(ValueError, match="vocabulary of 9 tokens; the model has 10"):
    draft_table.load(path, vocab_size=10)
  np.savez(str(tmp_path / "bad.npz"), offsets=np.array([0, 5]), second=np.zeros(2), follow=np.zeros(2))
  with pytest.raises(ValueError, match="not a draft table"):
    draft_table.load(str(tmp_path / "bad.npz"))
  with pytest.raises(ValueError, match="outside"):
    draft_table.build([[1, 2, 9]], 9)


def test_the_command_builds_a_table_from_chat_answers(tmp_path):
  path = tmp_path / "a.jsonl"
  rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "def f(x):\n    return x"}]}]
  path.write_text("\n".join(json.dumps(r) for r in rows * 3) + "\n")
  out = str(tmp_path / "t.npz")
  draft_table.main(["--checkpoint=mdlm_jax/assets/bd3_code_small", f"--answers={path}", f"--out={out}"])
  from mdlm_jax import checkpoints
  loaded = checkpoints.load("mdlm_jax/assets/bd3_code_small")
  ids = loaded.tokenizer.encode("def f(x):\n    return x")
  table = draft_table.load(out, loaded.spec.cfg.vocab_size)
  assert table.entries == len(_reference([ids]))
  (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
  with pytest.raises(ValueError, match="bad.jsonl:1: not a chat record"):
    draft_table.answers_of(str(tmp_path / "bad.jsonl"))
