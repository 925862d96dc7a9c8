"""Drafts from a table of answers (`sampling.draft_table`) against dictionaries built by hand."""

import collections
import json

import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.sampling import draft_table


def _reference(seqs, order, min_context, with_share=False):
  """{context tuple: its most frequent follower (the smallest id on a tie)} for each context length;
  `with_share`: (that follower, the share of the context's occurrences it followed)."""
  tables = {}
  for n in range(min_context, order + 1):
    counts = collections.defaultdict(collections.Counter)
    for s in seqs:
      for i in range(n - 1, len(s) - 1):
        counts[tuple(s[i - n + 1:i + 1])][s[i + 1]] += 1
    best = {k: min(c, key=lambda t: (-c[t], t)) for k, c in counts.items()}
    tables[n] = {k: (t, counts[k][t] / sum(counts[k].values())) if with_share else t for k, t in best.items()}
  return tables


def _answer(tables, context):
  """The follower of the longest suffix of `context` a table knows (with its share, if kept), or None."""
  for n in sorted(tables, reverse=True):
    if len(context) >= n and tuple(context[-n:]) in tables[n]:
      return tables[n][tuple(context[-n:])]
  return None


def _sixteenths(share):
  return round(share * draft_table.SHARE_STEPS) / draft_table.SHARE_STEPS


def _random_seqs(rng, vocab, n=40):
  # A small vocabulary: most contexts recur with several followers, so ties and counts matter.
  return [rng.integers(0, vocab, rng.integers(0, 30)).tolist() for _ in range(n)]


def _probe(rng, vocab, rows, width):
  """Random contexts whose first tokens (a random count of them) are not known text."""
  context = rng.integers(0, vocab, (rows, width))
  known = np.arange(width)[None] >= rng.integers(0, width + 1, rows)[:, None]
  return context, known


@pytest.mark.parametrize("order, min_context", [(4, 1), (4, 2), (2, 2), (3, 1), (5, 3)])
def test_each_context_maps_to_the_follower_of_its_longest_known_suffix(order, min_context):
  rng = np.random.default_rng()
  vocab = 6
  seqs = _random_seqs(rng, vocab)
  table, ref = draft_table.build(seqs, vocab, order, min_context), _reference(seqs, order, min_context)
  assert table.order == order
  context, known = _probe(rng, vocab, 600, order + 1)  # one more token than the table reads
  found, follow = table.next_token(jnp.asarray(context), jnp.asarray(known))
  answered = 0
  for r in range(len(context)):
    want = _answer(ref, [int(t) for t, k in zip(context[r], known[r]) if k])
    assert bool(found[r]) == (want is not None), r
    if want is not None:
      assert int(follow[r]) == want, r
      answered += 1
  assert answered > 100


def test_each_context_knows_how_often_its_follower_followed_it():
  rng = np.random.default_rng()
  vocab, order = 4, 3
  seqs = _random_seqs(rng, vocab, 60)
  table, ref = draft_table.build(seqs, vocab, order, 1), _reference(seqs, order, 1, with_share=True)
  context, known = _probe(rng, vocab, 400, order)
  found, follow, chance = table.lookup(jnp.asarray(context), jnp.asarray(known))
  shares = set()
  for r in range(len(context)):
    want = _answer(ref, [int(t) for t, k in zip(context[r], known[r]) if k])
    assert bool(found[r]) == (want is not None), r
    if want is not None:
      assert int(follow[r]) == want[0], r
      assert float(chance[r]) == pytest.approx(_sixteenths(want[1]), abs=1e-6), r
      shares.add(float(chance[r]))
    else:
      assert float(chance[r]) == 0.0
  assert len(shares) > 3


def test_contexts_that_answer_as_their_shorter_suffix_are_left_out():
  # "c" goes on with d four times in five (13 sixteenths), "b c" always: it
  # needs a node of its own; "a b c" and "x b c" answer as "b c" does and are
  # left out; "y c" (followed by z) needs its own.
  seqs = [[0, 1, 2, 3]] * 3 + [[4, 1, 2, 3]] + [[5, 2, 6]]
  table = draft_table.build(seqs, 7, order=3, min_context=1)
  assert table.key.shape[0] == 7 + 2  # the tokens, "1 2" -> 3 and "5 2" -> 6
  found, follow, chance = table.lookup(jnp.array([[0, 1, 2], [4, 1, 2], [6, 5, 2], [0, 0, 2]]),
                                       jnp.ones((4, 3), bool))
  assert np.asarray(found).all() and np.asarray(follow).tolist() == [3, 3, 6, 3]
  np.testing.assert_allclose(np.asarray(chance), [1.0, 1.0, 1.0, 13 / 16])


def test_a_wide_vocabulary_finds_contexts_in_long_ranges():
  rng = np.random.default_rng()
  vocab = 5000
  # One last token preceded by many tokens: one parent with hundreds of children.
  seqs = [[int(a), 3, int(c)] for a, c in zip(rng.integers(0, vocab, 600), rng.integers(0, vocab, 600))]
  table, ref = draft_table.build(seqs, vocab, 2, 2), _reference(seqs, 2, 2)
  probe = list(ref[2]) + [(int(x), 3) for x in rng.integers(0, vocab, 200)] + [(1, 4), (0, vocab - 1)]
  found, follow = table.next_token(jnp.asarray(probe), jnp.ones((len(probe), 2), bool))
  for i, pair in enumerate(probe):
    assert bool(found[i]) == (pair in ref[2])
    if pair in ref[2]:
      assert int(follow[i]) == ref[2][pair]


@pytest.mark.parametrize("nodes_per_bucket", [1e9, 0.25])
def test_lookups_are_exact_however_the_contexts_hash(nodes_per_bucket):
  # Every context in one bucket (each lookup reads them all and must tell them
  # apart by token and parent), and buckets four times the contexts.
  rng = np.random.default_rng()
  vocab, order = 5, 4
  seqs = _random_seqs(rng, vocab, 60)
  built, ref = draft_table.build(seqs, vocab, order, 1), _reference(seqs, order, 1)
  table = draft_table._table(built.children, built.key, built.follow, built.share, vocab, order, nodes_per_bucket)
  below = int(table.key.shape[0]) - vocab
  assert table.probe == (below if nodes_per_bucket > below else table.probe) and table.probe >= 1
  context, known = _probe(rng, vocab, 500, order + 1)
  found, follow = table.next_token(jnp.asarray(context), jnp.asarray(known))
  for r in range(len(context)):
    want = _answer(ref, [int(t) for t, k in zip(context[r], known[r]) if k])
    assert bool(found[r]) == (want is not None), r
    if want is not None:
      assert int(follow[r]) == want, r


def _extended(ref, context, known, ahead, n, floor=0.0):
  """The head with its free columns chained from the text's last tokens while
  the product of the chain's shares stays at least `floor`, in plain Python."""
  if n < 0:
    return list(ahead), n
  text = [int(t) for t, k in zip(context, known) if k]
  out = list(ahead[:n + 1])
  chance = 1.0
  while len(out) < len(ahead):
    nxt = _answer(ref, text + out)
    if nxt is None:
      break
    chance *= _sixteenths(nxt[1])
    if chance < floor:
      break
    out.append(nxt[0])
  return out + list(ahead[len(out):]), len(out) - 1


@pytest.mark.parametrize("floor", [0.0, 0.3, "rows"])
def test_a_head_is_extended_by_the_chain_from_the_text_before_it(floor):
  rng = np.random.default_rng()
  vocab, b, h, order = 5, 64, 5, 3
  seqs = _random_seqs(rng, vocab, 30)
  table, ref = draft_table.build(seqs, vocab, order, 2), _reference(seqs, order, 2, with_share=True)
  ahead = rng.integers(0, vocab, (b, h))
  n = rng.integers(-1, h, b)
  floors = rng.uniform(0, 0.6, b) if floor == "rows" else np.full(b, floor)
  context, known = _probe(rng, vocab, b, order - 1)
  out, count = table.extend(jnp.asarray(context), jnp.asarray(known), jnp.asarray(ahead), jnp.asarray(n),
                            jnp.asarray(floors, jnp.float32) if floor == "rows" else floor)
  grew = 0
  for r in range(b):
    want, c = _extended(ref, context[r].tolist(), known[r].tolist(), ahead[r].tolist(), int(n[r]),
                        np.float32(floors[r]))
    assert int(count[r]) == c, r
    np.testing.assert_array_equal(np.asarray(out[r, :c + 1]), want[:c + 1])
    grew += c > n[r]
  assert grew > 0


def test_the_context_before_a_head_is_read_from_the_text():
  rng = np.random.default_rng()
  table = draft_table.build(_random_seqs(rng, 5), 5, order=4)
  text = rng.integers(0, 5, (3, 10))
  known = rng.random((3, 10)) > 0.3
  end = np.array([0, 2, 9])
  context, ok = draft_table.context_before(table, jnp.asarray(text), jnp.asarray(known), jnp.asarray(end))
  for r in range(3):
    for j in range(3):
      at = end[r] - 3 + j
      assert bool(ok[r, j]) == (at >= 0 and bool(known[r, at]))
      if at >= 0:
        assert int(context[r, j]) == text[r, at]


def test_a_table_without_followers_extends_nothing():
  table = draft_table.build([[1], [], [2]], 4)
  out, count = table.extend(jnp.array([[0, 1, 1]]), jnp.ones((1, 3), bool), jnp.array([[2, 3, 0]]), jnp.array([0]))
  assert table.entries == 0 and int(count[0]) == 0 and np.asarray(out).tolist() == [[2, 3, 0]]


def test_saved_tables_load_and_bad_ones_are_named(tmp_path):
  rng = np.random.default_rng()
  seqs = _random_seqs(rng, 9)
  table = draft_table.build(seqs, 9)
  path = str(tmp_path / "t.npz")
  draft_table.save(table, path)
  back = draft_table.load(path, vocab_size=9)
  for name in ("children", "key", "follow", "share"):
    np.testing.assert_array_equal(getattr(back, name), getattr(table, name))
  assert (back.order, back.vocab_size, back.probe) == (table.order, table.vocab_size, table.probe)
  with pytest.raises(ValueError, match="vocabulary of 9 tokens; the model has 10"):
    draft_table.load(path, vocab_size=10)
  bad = dict(np.load(path))
  bad["key"] = bad["key"] + 9
  np.savez(str(tmp_path / "bad.npz"), **bad)
  with pytest.raises(ValueError, match="bad.npz is not a draft table over 9 tokens"):
    draft_table.load(str(tmp_path / "bad.npz"))
  bad["key"] = bad["key"] - 9
  bad["share"] = bad["share"] + draft_table.SHARE_STEPS + 1
  np.savez(str(tmp_path / "bad.npz"), **bad)
  with pytest.raises(ValueError, match="tokens or shares are out of range"):
    draft_table.load(str(tmp_path / "bad.npz"))
  old = {k: v for k, v in np.load(path).items() if k != "share"}  # saved before tables kept shares
  np.savez(str(tmp_path / "old.npz"), **old)
  sure = draft_table.load(str(tmp_path / "old.npz"))
  np.testing.assert_array_equal(sure.share, np.where(np.asarray(table.follow) >= 0, draft_table.SHARE_STEPS, 0))
  np.savez(str(tmp_path / "other.npz"), weights=np.zeros(2))
  with pytest.raises(ValueError, match=r"not a draft table: it holds \['weights'\]"):
    draft_table.load(str(tmp_path / "other.npz"))
  with pytest.raises(ValueError, match="outside"):
    draft_table.build([[1, 2, 9]], 9)


def test_a_table_of_token_pairs_in_the_first_format_loads_as_their_trie(tmp_path):
  rng = np.random.default_rng()
  vocab = 8
  pairs = _reference(_random_seqs(rng, vocab), 2, 2)[2]
  entries = sorted(pairs)  # by first token, then second
  offsets = np.searchsorted([a for a, _ in entries], np.arange(vocab + 1))
  np.savez(str(tmp_path / "pairs.npz"), offsets=offsets, second=np.array([b for _, b in entries]),
           follow=np.array([pairs[e] for e in entries]))
  table = draft_table.load(str(tmp_path / "pairs.npz"), vocab_size=vocab)
  probe = np.array([(a, b) for a in range(vocab) for b in range(vocab)])
  found, follow = table.next_token(jnp.asarray(probe), jnp.ones(probe.shape, bool))
  for i, (a, b) in enumerate(probe.tolist()):
    assert bool(found[i]) == ((a, b) in pairs)
    if (a, b) in pairs:
      assert int(follow[i]) == pairs[(a, b)]
  np.savez(str(tmp_path / "bad.npz"), offsets=np.array([0, 5]), second=np.zeros(2), follow=np.zeros(2))
  with pytest.raises(ValueError, match="not a draft table"):
    draft_table.load(str(tmp_path / "bad.npz"))


def test_the_command_builds_a_table_from_chat_answers(tmp_path):
  path = tmp_path / "a.jsonl"
  rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "def f(x):\n    return x"}]}]
  path.write_text("\n".join(json.dumps(r) for r in rows * 3) + "\n")
  out = str(tmp_path / "t.npz")
  draft_table.main(["--checkpoint=mdlm_jax/assets/bd3_code_small", f"--answers={path}", f"--out={out}",
                    "--order=3"])
  from mdlm_jax import checkpoints
  loaded = checkpoints.load("mdlm_jax/assets/bd3_code_small")
  ids = loaded.tokenizer.encode("def f(x):\n    return x")
  table, want = draft_table.load(out, loaded.spec.cfg.vocab_size), draft_table.build([ids] * 3, loaded.spec.cfg.vocab_size, 3)
  assert table.order == 3 and table.entries == want.entries > 0
  np.testing.assert_array_equal(table.follow, want.follow)
  (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
  with pytest.raises(ValueError, match="bad.jsonl:1: not a chat record"):
    draft_table.answers_of(str(tmp_path / "bad.jsonl"))


def test_the_command_weighs_each_file_and_reads_code_continuations(tmp_path):
  from mdlm_jax import checkpoints
  loaded = checkpoints.load("mdlm_jax/assets/bd3_code_small")
  vocab = loaded.spec.cfg.vocab_size
  chat, code = tmp_path / "chat.jsonl", tmp_path / "code.jsonl"
  chat.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": "def f(x):\n    return x"}]}) + "\n")
  code.write_text("".join(json.dumps({"prompt": "def f(x):\n", "completion": "    return y", "index": i}) + "\n"
                          for i in range(2)))
  a, b = (loaded.tokenizer.encode(t) for t in ("def f(x):\n    return x", "def f(x):\n    return y"))
  for weights, want in (("", [a] + [b] * 2), ("3,1", [a] * 3 + [b] * 2)):
    out = str(tmp_path / f"t{len(weights)}.npz")
    draft_table.main(["--checkpoint=mdlm_jax/assets/bd3_code_small", f"--answers={chat},{code}", f"--out={out}",
                      f"--weights={weights}"])
    got, ref = draft_table.load(out, vocab), draft_table.build(want, vocab)
    np.testing.assert_array_equal(got.follow, ref.follow)
    np.testing.assert_array_equal(got.share, ref.share)
  # the weights decide which follower the shared context keeps
  assert not np.array_equal(draft_table.build([a] + [b] * 2, vocab).follow, draft_table.build([a] * 3 + [b] * 2, vocab).follow)
  assert draft_table._weights("", 2) == [1, 1] and draft_table._weights("2,5", 2) == [2, 5]
  for bad in ("1", "1,0", "a,b"):
    with pytest.raises(ValueError, match="--weights"):
      draft_table._weights(bad, 2)
