"""The one finishing rule: EOS, stop strings, max_tokens, and the tokens usage counts."""

import numpy as np
import pytest

from mdlm_jax.sampling.finish import finish, first_stop, tokens_for_text

ALPHABET = "ab\n xy"


class CharTok:
  """Ids 3.. are characters, some two to a token; 2 is EOS and decodes to nothing."""
  eos_id = 2
  pieces = {i + 3: p for i, p in enumerate(list(ALPHABET) + ["ab", "\n\n", "xyz"])}

  def decode(self, ids):
    return "".join(self.pieces.get(int(i), "") for i in ids)


TOK = CharTok()
IDS = sorted(CharTok.pieces)


def reference(ids, max_tokens, stop, final):
  """Token by token: the first point where EOS, a stop string or max_tokens
  ends it; the tokens are those of the text returned."""
  ids = list(ids)[:max_tokens]
  for k in range(1, len(ids) + 1):
    if ids[k - 1] == TOK.eos_id:
      return TOK.decode(ids[:k - 1]), ids[:k - 1], "stop"
    text = TOK.decode(ids[:k])
    hits = [text.find(s) for s in stop if s in text]
    if hits:  # the tokens whose text is returned (some of it, at least)
      cut, n = min(hits), 0
      while len(TOK.decode(ids[:n])) < cut:
        n += 1
      return text[:cut], ids[:n], "stop"
  text = TOK.decode(ids)
  return text, ids, "length" if final or len(ids) >= max_tokens else None


def test_hand_computed_cases():
  a, b, nl, eos = 3, 4, 5, 2
  assert finish(TOK, [a, b, eos, a], max_tokens=8).text == "ab"
  assert finish(TOK, [a, b, eos, a], max_tokens=8).reason == "stop"
  assert finish(TOK, [a, b, a], max_tokens=2) == finish(TOK, [a, b], max_tokens=2)
  assert finish(TOK, [a, b, a], max_tokens=2).reason == "length"
  got = finish(TOK, [a, nl, nl, b, b], max_tokens=8, stop=["\n\n"])
  assert (got.text, got.tokens, got.reason) == ("a", [a], "stop")  # the stop string's tokens are not returned
  # A stop string that starts inside a token keeps that token (its text is partly returned).
  got = finish(TOK, [a, 3 + len(ALPHABET), b], max_tokens=8, stop=["bb"])  # "a" "ab" "b"
  assert (got.text, got.tokens) == ("aa", [a, 3 + len(ALPHABET)])
  # Not final: a tail that could still grow into a stop string is held back.
  partial = finish(TOK, [a, b, nl], max_tokens=8, stop=["\n\n"], final=False)
  assert (partial.text, partial.reason) == ("ab", None)
  assert finish(TOK, [a, b, nl], max_tokens=8, stop=["\n\n"], final=True).text == "ab\n"
  assert first_stop("abc\n\ndef", ["\n\n", "zz"]) == 3 and first_stop("abc", ["zz"]) == -1


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_token_by_token_reference(seed):
  rng = np.random.default_rng(seed)
  ids = rng.choice(IDS + [TOK.eos_id], size=rng.integers(0, 14), p=None).tolist()
  stop = ["".join(rng.choice(list(ALPHABET), size=rng.integers(1, 3))) for _ in range(rng.integers(0, 3))]
  max_tokens, final = int(rng.integers(1, 16)), bool(rng.integers(2))
  got = finish(TOK, ids, max_tokens=max_tokens, stop=stop, final=final)
  text, tokens, reason = reference(ids, max_tokens, stop, final)
  assert (got.tokens, got.reason) == (tokens, reason)
  if reason is None:  # held back: a prefix of the text, missing at most a stop string's start
    assert text.startswith(got.text) and len(text) - len(got.text) < max(map(len, stop), default=1)
    assert not any(s in text for s in stop)
  else:
    assert got.text == text


def test_tokens_for_text_is_the_shortest_prefix():
  rng = np.random.default_rng(7)
  ids = rng.choice(IDS, size=12).tolist()
  full = TOK.decode(ids)
  for n in range(len(full) + 1):
    k = tokens_for_text(TOK, ids, n)
    assert len(TOK.decode(ids[:k])) >= n and (k == 0 or len(TOK.decode(ids[:k - 1])) < n)
