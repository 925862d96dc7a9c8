"""Grammar constraints: the bitmask on the logits, the vocabulary llguidance
sees, and the host's accept rule, against hand-built cases and numpy."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.data.tokenizer import Tokenizer
from mdlm_jax.kernels.numerics import NEG_INF
from mdlm_jax.sampling import rule
from mdlm_jax.sampling.grammar import Constraint, Grammar, GrammarError, vocabulary

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_path):
  return Tokenizer.from_file(tiny_tokenizer_path)


def test_allow_masks_exactly_the_cleared_bits():
  rng = np.random.default_rng()
  v = int(rng.integers(40, 200))
  logits = rng.normal(size=(3, 5, v)).astype(np.float32)
  allowed = rng.random((3, 5, v)) < 0.3
  words = np.zeros((3, 5, (v + 31) // 32), np.uint32)
  for idx in zip(*np.nonzero(allowed)):
    *lead, t = idx
    words[(*lead, t // 32)] |= np.uint32(1 << (t % 32))
  got = np.asarray(rule.allow(jnp.asarray(logits), jnp.asarray(words)))
  np.testing.assert_array_equal(got, np.where(allowed, logits, NEG_INF))


def test_vocabulary_bytes_are_what_each_token_decodes_to(tok):
  pieces = tok.token_bytes()
  assert len(pieces) == tok.vocab_size
  for i in (tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id, tok.unk_id):
    assert pieces[i] is None
  rng = np.random.default_rng()
  whole = [i for i in rng.permutation(tok.vocab_size).tolist() if pieces[i] is not None and len(pieces[i]) > 1]
  ids = whole[:200]
  assert b"".join(pieces[i] for i in ids).decode() == tok.decode(ids)
  # Characters the vocabulary lacks are spelled in byte pieces.
  text = "x = '\U0001F600 \u00e9\t' + s\n"
  ids = tok.encode(text)
  assert b"".join(pieces[i] for i in ids) == text.encode()


def test_a_text_grammar_accepts_its_own_tokenisation(tok):
  vocab = vocabulary(tok, tok.vocab_size + 7)  # a padded model vocabulary
  text = json.dumps({"ok": True, "n": 2})
  c = Constraint(Grammar.json_schema(SCHEMA, layout="compact"), vocab, [tok.eos_id])
  ids = tok.encode(text)
  forced = c.forced(len(ids))
  assert forced and text.startswith(tok.decode(forced))  # '{"ok": ' is the only way to start
  rest = tok.encode(text[len(tok.decode(forced)):])
  assert c.accept(rest) == rest
  # The object is closed: nothing but the end may follow.
  assert c.ended or (c.accept([tok.eos_id]) == [tok.eos_id] and c.ended)


def test_json_layouts_allow_whitespace_as_they_say(tok):
  vocab = vocabulary(tok, tok.vocab_size)
  indented = tok.encode(json.dumps({"ok": True, "n": 2}, indent=int(np.random.default_rng().integers(1, 9))))

  def taken(grammar, ids):
    return len(Constraint(grammar, vocab, [tok.eos_id], policy="valid").accept(ids))

  # A chat model's own layout passes whole under "model"; "compact" stops at the first whitespace.
  assert taken(Grammar.json_schema(SCHEMA), indented) == len(indented)
  assert taken(Grammar.json_schema(SCHEMA, layout="compact"), indented) == 1  # "{" alone
  # Between two tokens: up to 16 spaces, a line break, up to 48 spaces of indentation; no more.
  rng = np.random.default_rng()
  before, after = int(rng.integers(0, 17)), int(rng.integers(0, 49))
  for gap, whole in ((" " * before + "\n" + " " * after, True), (" " * 16 + "\n" + " " * 48, True),
                     (" " * 17, False), ("\n" + " " * 49, False), ("\n\n", False)):
    ids = tok.encode("{" + gap + '"a": 1}')
    assert (taken(Grammar.json_object(), ids) == len(ids)) == whole, repr(gap)
  # A schema's own x-guidance options win over the layout: no whitespace at all.
  assert taken(Grammar.json_schema({**SCHEMA, "x-guidance": {"whitespace_pattern": ""}}), indented) == 1
  with pytest.raises(ValueError, match="layout"):
    Grammar.json_object(layout="pretty")


def test_accept_takes_the_grammatical_prefix_the_policy_allows(tok):
  vocab = vocabulary(tok, tok.vocab_size)
  digits = [tok.encode(str(d))[0] for d in range(10)]
  letter = tok.encode("x")[0]
  proposals = [digits[1], digits[2], digits[3], letter, digits[4]]
  picks = [True, False, True, False, True]
  regex = lambda policy: Constraint(Grammar.regex(r"[0-9]{1,8}"), vocab, [tok.eos_id], policy=policy)  # noqa: E731
  assert regex("valid").accept(proposals, picks) == proposals[:3]  # every grammatical proposal
  assert regex("bridge").accept(proposals, picks) == proposals[:3]  # through the last grammatical pick
  assert regex("bridge").accept(proposals, [True, True, False, False, False]) == proposals[:2]
  confident = regex("confident")
  assert confident.accept(proposals, picks) == proposals[:1]  # the picks leading from the cursor
  assert confident.accept(proposals[1:], [True, True, False, True, True]) == proposals[1:3]
  assert confident.accept([digits[5]], [False]) == [digits[5]]  # never fewer than the cursor's token
  # An end token where the grammar may end closes the output: EOS is
  # committed; another end token (a template's end of turn) ends it before.
  assert confident.accept([tok.eos_id, digits[6]], [True, True]) == [tok.eos_id] and confident.ended
  turn = Constraint(Grammar.regex(r"[0-9]{1,8}"), vocab, [tok.eos_id, letter])
  assert turn.accept([digits[1], letter, digits[2]]) == [digits[1]] and turn.ended
  assert turn.accept([digits[3]]) == []  # nothing after the end
  with pytest.raises(RuntimeError, match="not allowed"):
    Constraint(Grammar.regex(r"[0-9]+"), vocab, [tok.eos_id]).accept([letter])


def test_bitmask_allows_what_the_grammar_allows(tok):
  vocab = vocabulary(tok, tok.vocab_size)
  c = Constraint(Grammar.choice(["yes", "no"]), vocab, [tok.eos_id])
  bits = np.unpackbits(c.allowed().view(np.uint8), bitorder="little")[:tok.vocab_size]
  allowed = set(np.flatnonzero(bits).tolist())
  pieces = tok.token_bytes()
  assert allowed and all(b"yes".startswith(pieces[i]) or b"no".startswith(pieces[i]) for i in allowed)
  assert tok.encode("yes")[0] in allowed and tok.encode("no")[0] in allowed


@pytest.mark.parametrize("make, field", [
    (lambda: Grammar.regex("[a-"), "guided_regex"),
    (lambda: Grammar.lark("start: undefined_rule"), "guided_grammar"),
    (lambda: Grammar.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "response_format"),
    (lambda: Grammar.json_schema([1, 2]), "response_format"),
    (lambda: Grammar.choice([]), "guided_choice"),
])
def test_grammars_that_do_not_compile_name_their_field(tok, make, field):
  with pytest.raises(GrammarError) as e:
    Constraint(make(), vocabulary(tok, tok.vocab_size), [tok.eos_id])
  assert e.value.field == field


def test_gbnf_is_read_as_well_as_lark(tok):
  vocab = vocabulary(tok, tok.vocab_size)
  for text in ('root ::= "ab" [0-9]', 'start: "ab" /[0-9]/'):
    c = Constraint(Grammar.lark(text), vocab, [tok.eos_id], policy="valid")
    ids = tok.encode("ab7")
    assert c.accept(ids) == ids
