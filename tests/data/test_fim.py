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
