"""Fill-in-the-middle: the training transform, its pipeline, the prompt."""

import numpy as np
import pytest

from mdlm_jax.data import fim, pipeline

PIECES = {fim.PREFIX: 90, fim.SUFFIX: 91, fim.MIDDLE: 92}


class CharTok:
  """One id per character (its code point); the FIM markers as pieces."""
  bos_id, eos_id = 1, 2

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(chr(i) for i in ids)

  def piece_id(self, piece):
    if piece not in PIECES:
      raise ValueError(f"the tokenizer has no piece {piece!r}")
    return PIECES[piece]


FMT = fim.FIMFormat.of(CharTok())


def parse(ids):
  """(order, prefix, middle, suffix) of a transformed row; reference inverse."""
  ids = list(ids)
  assert ids[0] == 1 and ids[-1] == 2
  body = ids[1:-1]
  text = CharTok().decode
  if body[:2] == [90, 91]:  # SPM: suffix, then prefix + middle
    m = body.index(92)
    return "spm", text(body[2:m]), text(body[m + 1:])
  p, m = body.index(91), body.index(92)
  return "psm", text(body[1:p]), text(body[p + 1:m]), text(body[m + 1:])


def test_the_transform_rearranges_and_loses_nothing():
  rng = np.random.default_rng(0)
  text = "def f(x):\n    return x * 2\n"
  orders = []
  for _ in range(400):
    ids = FMT.training_tokens(CharTok(), text, rng, rate=1.0, spm_rate=0.5)
    order, *parts = parse(ids)
    orders.append(order)
    if order == "psm":
      prefix, suffix, middle = parts
      assert prefix + middle + suffix == text
    else:
      suffix, prefix_middle = parts
      assert text.endswith(suffix) and prefix_middle + suffix == text
  assert 160 < orders.count("spm") < 240  # half of 400, within 4 sigma
  plain = FMT.training_tokens(CharTok(), text, rng, rate=0.0)
  assert plain.tolist() == [1] + CharTok().encode(text) + [2]
  assert FMT.prompt(1, [5, 6], [7]) == [1, 90, 5, 6, 91, 7, 92]
  assert FMT.prompt(None, [5], []) == [90, 5, 91, 92]


def test_rate_is_the_fraction_transformed():
  rng = np.random.default_rng(1)
  hits = sum(90 in FMT.training_tokens(CharTok(), "abcdef", rng, rate=0.3).tolist() for _ in range(1000))
  assert 240 < hits < 360


def test_a_tokenizer_without_the_pieces_is_refused():
  class Plain(CharTok):
    def piece_id(self, piece):
      raise ValueError(f"the tokenizer has no piece {piece!r}")
  with pytest.raises(ValueError, match="--chat-fim-pieces"):
    fim.FIMFormat.of(Plain())


def test_the_pipeline_transforms_deterministically_and_resumes():
  docs = [f"def f{i}(x):\n    return x + {i}\n" * 3 for i in range(40)]
  make = lambda: pipeline.make_train_iterator(docs, CharTok(), seq_len=64, batch_size=2, seed=3, fim_rate=0.5)
  a, b = make(), make()
  first = [next(a)["tokens"] for _ in range(6)]
  assert all(np.array_equal(x, next(b)["tokens"]) for x in first)
  assert any(90 in x for x in first) and any(91 in x for x in first)
  state = a.get_state()
  want = [next(a)["tokens"] for _ in range(3)]
  c = make()
  c.set_state(state)
  assert all(np.array_equal(w, next(c)["tokens"]) for w in want)
  plain = pipeline.make_train_iterator(docs, CharTok(), seq_len=64, batch_size=2, seed=3)
  assert not any(90 in next(plain)["tokens"] for _ in range(6))


def _undo(got):
  """A rearranged run back in order (reference inverse of PSM and SPM)."""
  assert got[0] == 90
  if got[1] == 91:  # SPM: suffix, then prefix + middle
    m = got.index(92)
    return got[m + 1:] + got[2:m]
  p, m = got.index(91), got.index(92)
  return got[1:p] + got[m + 1:] + got[p + 1:m]


def test_context_level_rearranges_each_run_of_a_row_on_its_own():
  rng = np.random.default_rng(4)
  psm_with_prefix = 0
  for k in range(300):
    spm_rate = float(k % 2)  # all PSM, then all SPM
    # A packed row: the tail of one document, EOS BOS, a whole one, EOS BOS,
    # the head of a third, then EOS padding that absorbs the six markers the
    # cut of the row back to its length drops.
    runs = [rng.integers(100, 200, size=n).tolist() for n in rng.integers(1, 12, size=3)]
    row = np.asarray(runs[0] + [2, 1] + runs[1] + [2, 1] + runs[2] + [2] * 12, np.int32)
    out = FMT.context_tokens(row, (1, 2), rng, rate=1.0, spm_rate=spm_rate)
    assert out.shape == row.shape and out.dtype == row.dtype
    pieces, cur = [], []
    for t in out.tolist():
      if t in (1, 2):
        pieces.append(cur)
        cur = []
      else:
        cur.append(t)
    assert [_undo(p) for p in pieces[:5:2]] == runs and not any(pieces[1:5:2])
    assert [t for t in out.tolist() if t in (1, 2)] == [2, 1, 2, 1] + [2] * 3  # 9 markers = 9 EOS fewer
    # SPM opens with both markers; so does PSM only when its prefix is empty.
    if spm_rate:
      assert all(p[:2] == [90, 91] for p in pieces[:5:2])
    else:
      psm_with_prefix += sum(p[1] != 91 for p in pieces[:5:2])
  assert psm_with_prefix > 300
  # Rate 0: the row as it was; a cut row keeps its length.
  row = np.asarray([7, 8, 2, 1, 5, 6, 9], np.int32)
  assert FMT.context_tokens(row, (1, 2), rng, rate=0.0).tolist() == row.tolist()
  cut = FMT.context_tokens(row, (1, 2), rng, rate=1.0)
  assert len(cut) == len(row) and cut[0] == 90


def test_the_pipeline_at_context_level_keeps_every_example_in_its_row_and_resumes():
  docs = [f"def f{i}(x):\n    return x + {i}\n" * 9 for i in range(40)]  # each longer than a row
  make = lambda: pipeline.make_train_iterator(docs, CharTok(), seq_len=64, batch_size=2, seed=3, fim_rate=1.0,
                                              fim_level="context")
  a, b = make(), make()
  rows = [r for _ in range(6) for r in next(a)["tokens"]]
  assert all(np.array_equal(x, y) for x, y in zip(rows, [r for _ in range(6) for r in next(b)["tokens"]]))
  for row in rows:
    # Every prefix marker's suffix and middle markers follow in the same row,
    # unless the row's end cut the last example.
    marks = [t for t in row.tolist() if t in (90, 91, 92)]
    whole = len(marks) // 3 * 3
    assert marks[:whole] == [90, 91, 92] * (whole // 3) and marks[whole:] in ([], [90], [90, 91])
    assert marks  # rate 1: every row holds an example
  state = a.get_state()
  want = [next(a)["tokens"] for _ in range(3)]
  c = make()
  c.set_state(state)
  assert all(np.array_equal(w, next(c)["tokens"]) for w in want)
  with pytest.raises(ValueError, match="fim_level"):
    pipeline.make_train_iterator(docs, CharTok(), seq_len=64, batch_size=2, seed=3, fim_rate=1.0, fim_level="row")
