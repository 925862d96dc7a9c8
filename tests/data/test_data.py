"""Corpora, splits and the resumable packed pipeline."""

import json
import os

import numpy as np
import pytest

from mdlm_jax import data
from mdlm_jax.data.tokenizer import Tokenizer, train_tokenizer

SEQ, BATCH = 64, 4


@pytest.fixture(scope="module")
def train_docs() -> list[str]:
  return data.load_documents("stdlib", "train", 0.05)


@pytest.fixture(scope="module")
def tok(train_docs, tmp_path_factory) -> Tokenizer:
  path = tmp_path_factory.mktemp("tok") / "tok.model"
  return train_tokenizer(train_docs, str(path), vocab_size=320, max_chars=200_000)


@pytest.fixture(scope="module")
def small_docs(train_docs) -> list[str]:
  """Short documents so epochs, shuffles and shards show up in few batches."""
  return [d[:600] for d in train_docs[:40]]


def _take(it, n: int) -> list[np.ndarray]:
  return [next(it)["tokens"] for _ in range(n)]


# ----------------------------------------------------------------- documents


def test_stdlib_files():
  files = data.stdlib_files()
  root = data.stdlib_root()
  rel = {os.path.relpath(p, root).replace(os.sep, "/") for p in files}
  assert files == sorted(files)
  assert {"json/decoder.py", "os.py", "email/message.py"} <= rel
  for r in rel:
    parts = r.split("/")
    assert r.endswith(".py")
    assert not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(parts), r


def test_split_of_is_stable_and_proportional():
  keys = [f"pkg/mod_{i}.py" for i in range(4000)]
  splits = [data.split_of(k, 0.1) for k in keys]
  assert splits == [data.split_of(k, 0.1) for k in keys]
  assert set(splits) == {"train", "validation"}
  assert 0.08 < splits.count("validation") / len(keys) < 0.12
  assert data.split_of("json/decoder.py", 0.0) == "train"
  assert data.split_of("json/decoder.py", 1.0) == "validation"


def test_split_of_known_values():
  # Pinned: they must hold on every machine and process, and a change of
  # hash would silently move files between splits of existing runs.
  got = [data.split_of(k, 0.5) for k in "abcdefgh"]
  assert got == ["train"] + ["validation"] * 5 + ["train"] * 2


def test_stdlib_splits_are_disjoint(train_docs):
  val = data.load_documents("stdlib", "validation", 0.05)
  assert val and train_docs
  assert not set(val) & set(train_docs)
  assert len(val) < len(train_docs)


def _make_corpus(tmp_path):
  root = tmp_path / "corpus"
  (root / "pkg").mkdir(parents=True)
  (root / ".git").mkdir()
  texts = {f"pkg/m{i}.py": f"def f{i}():\n\treturn {i}  # é\n" for i in range(30)}
  texts["top.txt"] = "plain text\n"
  for rel, text in texts.items():
    (root / rel).write_text(text, encoding="utf-8")
  (root / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
  (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
  (root / "empty.py").write_text("")
  return root, texts


def test_load_directory_and_glob(tmp_path):
  root, texts = _make_corpus(tmp_path)
  both = {s: data.load_documents(str(root), s, 0.3) for s in data.SPLITS}
  assert sorted(both["train"] + both["validation"]) == sorted(texts.values())
  assert both["train"] and both["validation"]
  py = {s: data.load_documents(str(root / "pkg" / "*.py"), s, 0.3) for s in data.SPLITS}
  assert sorted(py["train"] + py["validation"]) == sorted(
      t for r, t in texts.items() if r.endswith(".py"))
  rec = data.load_documents(str(root / "**" / "*.txt"), "train", 0.001)
  assert rec == ["plain text\n"]
  # Repeated calls give the same documents in the same order.
  assert data.load_documents(str(root), "train", 0.3) == both["train"]


def test_load_jsonl(tmp_path):
  path = tmp_path / "c.jsonl"
  records = [{"body": f"doc {i}\n", "id": i} for i in range(50)]
  path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
  train = data.load_documents(str(path), "train", 0.2, text_field="body")
  val = data.load_documents(str(path), "validation", 0.2, text_field="body")
  assert sorted(train + val) == sorted(r["body"] for r in records)
  assert val == [f"doc {i}\n" for i in range(50) if data.split_of(str(i), 0.2) == "validation"]


def test_load_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="/no/such/dir"):
    data.load_documents("/no/such/dir", "train", 0.1)
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    data.load_documents(str(tmp_path / "missing.jsonl"), "train", 0.1)
  with pytest.raises(ValueError, match=r"nothing\*\.txt"):
    data.load_documents(str(tmp_path / "nothing*.txt"), "train", 0.1)
  with pytest.raises(ValueError, match="split"):
    data.load_documents("stdlib", "test", 0.1)
  (tmp_path / "one.txt").write_text("x")
  with pytest.raises(ValueError, match="'validation' split"):
    data.load_documents(str(tmp_path / "one.txt"), "validation", 0.0)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"text": oops}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
    data.load_documents(str(bad), "train", 0.1)
  nofield = tmp_path / "nofield.jsonl"
  nofield.write_text('{"text": "ok"}\n{"body": "x"}\n')
  with pytest.raises(ValueError, match=r"nofield.jsonl:2: no field 'text'"):
    data.load_documents(str(nofield), "train", 0.1)
  notstr = tmp_path / "notstr.jsonl"
  notstr.write_text('{"text": 3}\n')
  with pytest.raises(ValueError, match=r"notstr.jsonl:1: field 'text' is int"):
    data.load_documents(str(notstr), "train", 0.1)


# ------------------------------------------------------------------ pipeline


def _iter(docs, tok, seed=0, **kw):
  return data.make_train_iterator(docs, tok, seq_len=SEQ, batch_size=BATCH, seed=seed, **kw)


def test_batches_shape_dtype_and_content(small_docs, tok):
  batches = _take(_iter(small_docs, tok), 30)
  for b in batches:
    assert b.shape == (BATCH, SEQ) and b.dtype == np.int32
    assert b.min() >= 0 and b.max() < tok.vocab_size
  stream = np.concatenate([b.ravel() for b in batches])
  # Packed [bos] doc [eos] [bos] doc [eos] ...: the first token is a BOS,
  # every EOS is followed by a BOS, and no padding or mask appears.
  assert stream[0] == tok.bos_id
  eos = np.flatnonzero(stream[:-1] == tok.eos_id)
  assert len(eos) > 10
  assert (stream[eos + 1] == tok.bos_id).all()
  assert not np.isin(stream, [tok.pad_id, tok.mask_id]).any()
  # The first document comes through whole and exact.
  first = tok.decode(stream[:eos[0] + 1])
  assert first in small_docs


def test_seed_determinism(small_docs, tok):
  a = _take(_iter(small_docs, tok, seed=3), 25)
  b = _take(_iter(small_docs, tok, seed=3), 25)
  c = _take(_iter(small_docs, tok, seed=4), 25)
  assert all((x == y).all() for x, y in zip(a, b))
  assert not all((x == y).all() for x, y in zip(a, c))


def _doc_order(docs, tok, n_batches, **kw) -> list[str]:
  stream = np.concatenate([b.ravel() for b in _take(_iter(docs, tok, **kw), n_batches)])
  bounds = np.flatnonzero(stream == tok.eos_id)
  return [tok.decode(stream[s + 1:e + 1]) for s, e in zip(bounds[:-1], bounds[1:])]


def test_epochs_cover_all_docs_and_reshuffle(tok):
  docs = [f"document number {i}\n" for i in range(12)]
  order = _doc_order(docs, tok, 12, seed=0)  # several epochs of 12 docs.
  assert len(order) > 36
  # order[0] is the stream's second document (the first has no EOS before it).
  epoch1, epoch2 = order[11:23], order[23:35]
  assert sorted(epoch1) == sorted(docs) and sorted(epoch2) == sorted(docs)
  assert epoch1 != epoch2


def test_process_shards_are_disjoint(tok):
  docs = [f"shard doc {i}\n" for i in range(20)]
  seen = [set(_doc_order(docs, tok, 6, process_index=i, process_count=2)) for i in range(2)]
  assert seen[0] and seen[1]
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == set(docs)
  with pytest.raises(ValueError, match="3 documents"):
    _iter(docs[:3], tok, process_count=4)
  with pytest.raises(ValueError, match="process_index"):
    _iter(docs, tok, process_index=2, process_count=2)


def test_fixed_reader_shards_give_the_same_global_batch_for_any_process_count(small_docs, tok):
  """With data.num_shards fixed, the processes' batches side by side (process
  order, as the batch sharding places them) are the one-process batch."""
  one = _take(data.make_train_iterator(small_docs, tok, seq_len=SEQ, batch_size=BATCH, seed=3, num_shards=2), 5)
  two = [_take(data.make_train_iterator(small_docs, tok, seq_len=SEQ, batch_size=BATCH // 2, seed=3,
                                        process_index=i, process_count=2, num_shards=2), 5) for i in range(2)]
  for k in range(5):
    np.testing.assert_array_equal(one[k], np.concatenate([two[0][k], two[1][k]]))
  # The two-shard iterator of one process also resumes exactly from its JSON state.
  it = data.make_train_iterator(small_docs, tok, seq_len=SEQ, batch_size=BATCH, seed=3, num_shards=2)
  _take(it, 2)
  fresh = data.make_train_iterator(small_docs, tok, seq_len=SEQ, batch_size=BATCH, seed=3, num_shards=2)
  fresh.set_state(json.loads(json.dumps(it.get_state())))
  np.testing.assert_array_equal(_take(fresh, 3), one[2:])
  with pytest.raises(ValueError, match="3 reader shards cannot be split evenly over 2"):
    data.make_train_iterator(small_docs, tok, seq_len=SEQ, batch_size=BATCH, seed=3, process_count=2,
                             num_shards=3)


def test_state_json_round_trip_resumes_exactly(small_docs, tok):
  reference = _take(_iter(small_docs, tok, seed=7), 40)
  for k in (0, 1, 13, 29):  # mid-document and across epoch boundaries.
    it = _iter(small_docs, tok, seed=7)
    _take(it, k)
    state = json.loads(json.dumps(it.get_state()))
    fresh = _iter(small_docs, tok, seed=7)
    fresh.set_state(state)
    resumed = _take(fresh, 40 - k)
    assert all((x == y).all() for x, y in zip(resumed, reference[k:])), k
    # The original iterator is unaffected by get_state.
    assert (next(it)["tokens"] == reference[k]).all()


def test_eval_batches(small_docs, tok):
  a = data.make_eval_batches(small_docs, tok, seq_len=SEQ, batch_size=BATCH, num_batches=5)
  b = data.make_eval_batches(small_docs, tok, seq_len=SEQ, batch_size=BATCH, num_batches=5)
  assert len(a) == 5
  assert all(x.shape == (BATCH, SEQ) and x.dtype == np.int32 for x in a)
  assert all((x == y).all() for x, y in zip(a, b))
  stream = np.concatenate([x.ravel() for x in a])
  expected = np.concatenate([[tok.bos_id] + tok.encode(d) + [tok.eos_id] for d in small_docs])
  np.testing.assert_array_equal(stream, expected[:len(stream)])
  everything = data.make_eval_batches(small_docs, tok, seq_len=SEQ, batch_size=BATCH,
                                      num_batches=10_000)
  assert len(everything) == len(expected) // (SEQ * BATCH)  # remainder dropped.


def test_eval_batches_too_little_data(tok):
  with pytest.raises(ValueError, match=r"needs 256"):
    data.make_eval_batches(["tiny\n"], tok, seq_len=SEQ, batch_size=BATCH, num_batches=2)
