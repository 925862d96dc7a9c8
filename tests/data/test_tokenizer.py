"""The tokenizer must be lossless on code and keep its special ids apart."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from mdlm_jax import data
from mdlm_jax.data.tokenizer import CHAT_AND_FIM_PIECES, MASK_PIECE, Tokenizer, train_tokenizer

from tests.conftest import REPO
# Real sources with unicode (shlex, re/_casefix), long docstrings and tables.
STDLIB_SAMPLES = ("json/decoder.py", "shlex.py", "re/_casefix.py", "zipfile.py",
                  "textwrap.py", "encodings/koi8_t.py")
TRICKY = ("\tdef f(x):\n\t\treturn 'é'  # 😀 naïve ☃\n\n\n"
          "    x  =   1    \n  \t \n\r\n\x0c\x00"
          "literal \u2581 marker\u2581\u2581, [MASK] <s> </s> <pad> <unk>"
          "\u3000ideographic\u00a0nbsp e\u0301 ﬁ 𝔘 \U0010ffff")


def _stdlib_text(rel: str) -> str:
  with open(os.path.join(data.stdlib_root(), rel), encoding="utf-8") as f:
    return f.read()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
  return str(tmp_path_factory.mktemp("tok") / "sub" / "tok.model")


@pytest.fixture(scope="module")
def tok(model_path) -> Tokenizer:
  docs = data.load_documents("stdlib", "train", 0.05)
  return train_tokenizer(docs, model_path, vocab_size=400, max_chars=400_000)


@pytest.mark.parametrize("rel", STDLIB_SAMPLES)
def test_stdlib_sources_round_trip_exactly(tok, rel):
  text = _stdlib_text(rel)
  assert tok.decode(tok.encode(text)) == text


def test_many_stdlib_files_round_trip(tok):
  files = data.stdlib_files()[::40]
  for path in files:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    assert tok.decode(tok.encode(text)) == text, path


@pytest.mark.parametrize("text", [TRICKY, "", " ", "\n", "   lead", "trail\t", "▁", "\u2581 \u2581"])
def test_hand_written_round_trip(tok, text):
  ids = tok.encode(text)
  assert all(isinstance(i, int) for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode(np.asarray(ids, np.int32)) == text


def test_special_ids_are_distinct_and_decoded_away(tok):
  special = [tok.mask_id, tok.bos_id, tok.eos_id, tok.pad_id]
  assert len(set(special)) == 4
  assert all(0 <= i < tok.vocab_size for i in special)
  assert tok.piece(tok.mask_id) == MASK_PIECE
  ids = tok.encode(TRICKY)
  assert not set(special) & set(ids)  # "[MASK]" in text is text, not the mask.
  noisy = [tok.bos_id] + ids[:5] + [tok.mask_id, tok.pad_id] + ids[5:] + [tok.eos_id, tok.pad_id]
  assert tok.decode(noisy) == TRICKY


def test_vocab_is_as_requested(tok):
  assert tok.vocab_size == 400


def test_bytes_file_and_pickle_round_trip(tok, model_path):
  text = _stdlib_text("json/decoder.py")
  for other in (Tokenizer.from_bytes(tok.to_bytes()), Tokenizer.from_file(model_path),
                pickle.loads(pickle.dumps(tok))):
    assert other.to_bytes() == tok.to_bytes()
    assert other.vocab_size == tok.vocab_size
    assert other.mask_id == tok.mask_id
    assert other.encode(text) == tok.encode(text)
  assert os.listdir(os.path.dirname(model_path)) == ["tok.model"]  # no temp files left.


def test_load_errors(tmp_path):
  missing = tmp_path / "nope.model"
  with pytest.raises(FileNotFoundError, match="nope.model"):
    Tokenizer.from_file(missing)
  garbage = tmp_path / "garbage.model"
  garbage.write_bytes(b"not a model")
  with pytest.raises(ValueError, match="garbage.model"):
    Tokenizer.from_file(garbage)


def test_decode_rejects_bad_ids(tok):
  with pytest.raises(ValueError, match="1-D"):
    tok.decode(np.zeros((2, 3), np.int32))
  with pytest.raises(ValueError, match=str(tok.vocab_size)):
    tok.decode([tok.vocab_size])
  assert tok.decode([]) == ""


def test_train_errors(tmp_path):
  with pytest.raises(ValueError, match="vocab_size=100"):
    train_tokenizer(["x = 1\n"], str(tmp_path / "a.model"), vocab_size=100)
  with pytest.raises(ValueError, match="no training text"):
    train_tokenizer(["", ""], str(tmp_path / "b.model"), vocab_size=300)
  assert not list(tmp_path.iterdir())


def test_small_vocab_and_tiny_corpus(tmp_path):
  # 300 slots cannot hold every stdlib character; 400 exceeds what a tiny
  # corpus can merge. Both must still train and stay lossless.
  docs = [_stdlib_text(r) for r in STDLIB_SAMPLES]
  small = train_tokenizer(docs, str(tmp_path / "s.model"), vocab_size=300, max_chars=100_000)
  assert small.vocab_size == 300
  tiny = train_tokenizer(["def f(x):\n    return x\n"], str(tmp_path / "t.model"), vocab_size=400)
  assert tiny.vocab_size <= 400
  for t in (small, tiny):
    for text in docs + [TRICKY]:
      assert t.decode(t.encode(text)) == text


def _cli(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, "-m", "mdlm_jax.tokenizer", *args],
                        capture_output=True, text=True, env=env, timeout=120, check=False)


def test_cli_train_and_encode(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i, rel in enumerate(STDLIB_SAMPLES[:3]):
    (corpus / f"f{i}.py").write_text(_stdlib_text(rel)[:20_000], encoding="utf-8")
  out = tmp_path / "cli.model"
  # validation_fraction small so that the 3-file train split is not empty.
  r = _cli("train", f"--corpus={corpus}", f"--out={out}", "--vocab-size=300",
           "--max-chars=50000", "--validation-fraction=0.01")
  assert r.returncode == 0, r.stderr
  assert "vocab" in r.stdout
  r = _cli("encode", f"--model={out}", "--text=def f(x):\n\treturn x")
  assert r.returncode == 0, r.stderr
  ids = [int(i) for i in r.stdout.split()]
  assert ids == Tokenizer.from_file(out).encode("def f(x):\n\treturn x")


@pytest.mark.parametrize("args, needle", [
    (("train", "--corpus=/no/such/dir", "--out=x.model", "--vocab-size=300"), "/no/such/dir"),
    (("encode", "--model=/no/such.model", "--text=x"), "/no/such.model"),
    (("train", "--corpus=stdlib", "--out=x.model", "--vocab-size=ten"), "vocab-size"),
    (("frobnicate",), "frobnicate"),
])
def test_cli_errors_are_one_line(args, needle):
  r = _cli(*args)
  assert r.returncode != 0
  assert needle in r.stderr
  assert "Traceback" not in r.stderr
  assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_chat_and_fim_pieces_are_one_token_each(tmp_path):
  docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(200)]
  tok = train_tokenizer(docs, str(tmp_path / "c.model"), vocab_size=400, user_pieces=CHAT_AND_FIM_PIECES)
  ids = {p: tok.piece_id(p) for p in CHAT_AND_FIM_PIECES}
  assert len(set(ids.values())) == len(ids) and not set(ids.values()) & {tok.mask_id, tok.bos_id, tok.eos_id}
  for piece, i in ids.items():
    assert tok.encode(piece) == [i] and tok.decode([i]) == piece
  text = "<|fim_prefix|>def f(x):\n<|fim_suffix|>\n    return y\n<|fim_middle|>    y = x<|im_end|>"
  got = tok.encode(text)
  assert tok.decode(got) == text
  assert [t for t in got if t in ids.values()] == [ids["<|fim_prefix|>"], ids["<|fim_suffix|>"],
                                                   ids["<|fim_middle|>"], ids["<|im_end|>"]]
  with pytest.raises(ValueError, match="no piece"):
    tok.piece_id("<|nothing|>")
