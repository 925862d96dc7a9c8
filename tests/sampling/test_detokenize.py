"""A growing sequence's text decoded a window at a time equals its whole decode."""

import numpy as np
import pytest

from mdlm_jax.sampling.detokenize import IncrementalText

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>"]
SPECIAL_IDS = {"eos_token_id": 0, "bos_token_id": 1, "mask_token_id": 3}
TEXTS = ["def f(x):\n    return x ** 2 + 12345\n",
         "# héllo wörld 日本語 ✓ — emoji 🙂 naïve café\nprint(f'{a!r:>10}')\n",
         "   leading spaces,\ttabs\t and  double  spaces  \n\n\n",
         "Here is a Python function that sorts a list:\n\n```python\ndef s(xs):\n    return sorted(xs)\n```\n"]


@pytest.fixture(scope="module")
def byte_bpe():
  """A byte-level BPE as SmolLM2's, behind our HFTokenizer (special ids vanish in decode)."""
  from mdlm_jax.data.hf_tokenizer import HFTokenizer
  from tests.byte_bpe import byte_level_bpe_json
  return HFTokenizer(byte_level_bpe_json(TEXTS * 8, 420, SPECIALS), SPECIAL_IDS)


@pytest.fixture(scope="module")
def metaspace():
  """A BPE with Llama-2's spaces ("▁"), whose decoder drops the first token's leading space."""
  from tokenizers import decoders, models, pre_tokenizers, trainers
  from mdlm_jax.data.hf_tokenizer import HFTokenizer
  tk = tokenizers.Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.Metaspace()
  tk.decoder = decoders.Metaspace()
  tk.train_from_iterator(TEXTS * 8, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False))
  return HFTokenizer(tk.to_str(), SPECIAL_IDS)


@pytest.fixture(scope="module")
def sentencepiece(tiny_tokenizer_path):
  from mdlm_jax.data.tokenizer import Tokenizer
  return Tokenizer.from_file(tiny_tokenizer_path)


class LeftStripped:
  """A decoder that strips all leading whitespace (as some clean-ups do):
  a window of spaces alone renders as nothing and must not be trusted."""
  vocab_size = 40
  pieces = [" ", "  ", "\n", "\t", "a", "b", "é", "日", " x", "y "] * 4

  def decode(self, ids):
    return "".join(self.pieces[int(i)] for i in ids).lstrip()

  def encode(self, text):
    raise NotImplementedError


@pytest.fixture
def left_stripped():
  return LeftStripped()


def vocab(tok) -> int:
  return getattr(tok, "vocab_size", None) or tok._vocab  # pylint: disable=protected-access


def grow_and_check(tok, ids, rng, restarts=True):
  """Feeds `ids` in passes of 1 to 4 tokens (now and then cut back, as a
  taken-back draft or a new request would); every call's text must be the
  whole decode's. Returns the share of calls that decoded whole."""
  inc, calls, n = IncrementalText(tok), 0, 0
  while n < len(ids):
    n += int(rng.integers(1, 5))
    if restarts and rng.random() < 0.05:
      n = int(rng.integers(0, n + 1))
    got, want = inc.text(ids[:n]), tok.decode(ids[:n])
    assert got == want, (n, got[-40:], want[-40:])
    calls += 1
  return inc.full_decodes / calls


@pytest.mark.parametrize("kind", ["byte_bpe", "metaspace", "sentencepiece", "left_stripped"])
def test_random_ids_decode_as_a_whole(kind, request):
  """Random ids, half of them from the ones a window is likeliest to render
  otherwise than the whole: special ids (which vanish), whitespace pieces
  (which a decoder may strip at the start) and stray bytes of characters."""
  tok = request.getfixturevalue(kind)
  rng = np.random.default_rng()
  n = vocab(tok)
  tricky = [i for i in range(n) if tok.decode([i]).strip() == "" or "\ufffd" in tok.decode([i])]
  assert len(tricky) > 3
  for _ in range(30):
    size = int(rng.integers(1, 300))
    ids = np.where(rng.random(size) < 0.5, rng.choice(tricky, size), rng.integers(0, n, size))
    grow_and_check(tok, ids, rng)


@pytest.mark.parametrize("kind", ["byte_bpe", "metaspace", "sentencepiece"])
def test_real_text_decodes_a_window_a_pass(kind, request):
  """On text (unicode, spaces, newlines), nearly every call decodes only a window."""
  tok = request.getfixturevalue(kind)
  rng = np.random.default_rng()
  ids = np.asarray(tok.encode("".join(rng.permutation(TEXTS * 6))))
  share = grow_and_check(tok, ids, rng, restarts=False)
  assert share < 0.1, share


def test_context_must_be_positive(byte_bpe):
  with pytest.raises(ValueError, match="context"):
    IncrementalText(byte_bpe, context=0)
