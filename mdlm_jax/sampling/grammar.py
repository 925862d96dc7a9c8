"""Grammar constraints on the refinement rule: the host half.

A constrained row commits left to right. Each pass the device applies the
row's token bitmask at its first undecided column (`rule.allow`), so the
proposal there is always grammatical; the host then walks the row's
proposals in position order and commits the longest prefix the grammar
accepts (`Constraint.accept`), at least that first token. A pass over a
grammatical draft therefore commits many tokens, like the verify step of
speculative decoding, and never fewer than one.

The grammar engine is llguidance: no dependencies, any vocabulary given as
token bytes, JSON schema / regex / Lark grammars, a next-token bitmask in
microseconds and `try_consume_tokens` for the longest valid prefix. (xgrammar
needs torch and transformers; outlines-core has no Lark grammars or
`$ref` cycles.)
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from typing import Any, Sequence

import numpy as np

ACCEPT_POLICIES = ("bridge", "confident", "valid")  # the first is the default
# JSON as `json.dumps` writes it: no passes spent on whitespace, and the keys
# a schema requires are forced whole. Tool calls are held to it (the chat
# template shows them so).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# JSON as a chat model writes it: between any two tokens, a line break at
# most, with up to 16 spaces or tabs before it and 48 after (indentation),
# so whitespace cannot run on; "," and ": ". Structured outputs default to
# it: held to the compact layout, SmolLM2 answered a json_object request
# with '{"\\n\\n...' (its newline after "{" forbidden, it opened a key and
# wrote escaped newlines until max_tokens) (`bench layouts`, docs/serving.md).
MODEL_LAYOUT = {"whitespace_pattern": r"[\x20\x09]{0,16}(\x0D?\x0A[\x20\x09]{0,48})?", "item_separator": ",",
                "key_separator": ": "}
LAYOUTS = {"model": MODEL_LAYOUT, "compact": JSON_LAYOUT}


class GrammarError(ValueError):
  """A schema, regex or grammar the engine cannot compile; `field` names what
  the request called it."""

  def __init__(self, message: str, field: str = "grammar"):
    super().__init__(message)
    self.field = field


def _llg():
  try:
    import llguidance  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - a dependency; only a broken install lacks it
    raise GrammarError(f"constrained decoding needs llguidance ({e})") from None
  return llguidance


@dataclasses.dataclass(frozen=True)
class Grammar:
  """A compiled-on-demand grammar: llguidance's serialised form plus the
  request field it came from (for error messages)."""
  source: str
  field: str = "grammar"

  @classmethod
  def json_schema(cls, schema: dict[str, Any] | bool, field: str = "response_format",
                  layout: str = "model") -> Grammar:
    """Output valid under `schema`, laid out as LAYOUTS[layout] says unless
    the schema's own "x-guidance" options say otherwise."""
    if not isinstance(schema, (dict, bool)):
      raise GrammarError("a JSON schema must be an object", field)
    if layout not in LAYOUTS:
      raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    try:
      return cls(_llg().LLMatcher.grammar_from_json_schema(schema, defaults=LAYOUTS[layout]), field)
    except (ValueError, TypeError) as e:
      raise GrammarError(f"invalid JSON schema: {e}", field) from None

  @classmethod
  def json_object(cls, field: str = "response_format", layout: str = "model") -> Grammar:
    """Any JSON object (OpenAI's json_object mode)."""
    return cls.json_schema({"type": "object"}, field, layout)

  @classmethod
  def regex(cls, pattern: str, field: str = "guided_regex") -> Grammar:
    if not isinstance(pattern, str) or not pattern:
      raise GrammarError("a regex must be a non-empty string", field)
    return cls(_llg().LLMatcher.grammar_from_regex(pattern), field)

  @classmethod
  def lark(cls, text: str, field: str = "guided_grammar") -> Grammar:
    """A Lark grammar, or a GBNF one (llama.cpp's EBNF, `root ::= ...`),
    which llguidance translates to Lark."""
    if not isinstance(text, str) or not text.strip():
      raise GrammarError("a grammar must be a non-empty string", field)
    from llguidance.gbnf_to_lark import any_to_lark  # pylint: disable=import-outside-toplevel
    try:
      text = any_to_lark(text)
    except Exception as e:  # the translator raises its own error types  # pylint: disable=broad-except
      raise GrammarError(f"invalid grammar: {e}", field) from None
    return cls(_llg().LLMatcher.grammar_from_lark(text), field)

  @classmethod
  def choice(cls, options: Sequence[str], field: str = "guided_choice") -> Grammar:
    """Exactly one of `options`."""
    if not options or not all(isinstance(o, str) and o for o in options):
      raise GrammarError("choices must be a non-empty list of non-empty strings", field)
    return cls(_llg().LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)), field)


# One llguidance tokenizer per (tokenizer, model vocabulary): building one
# reads the whole vocabulary.
_VOCABS: "weakref.WeakKeyDictionary[Any, dict[int, Any]]" = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def vocabulary(tok, n_vocab: int):
  """llguidance's view of `tok` (a `data.Tokenizer` or `HFTokenizer`) over the
  model's `n_vocab` logits: every id's bytes, special ids behind llguidance's
  0xFF marker so no text ever matches them, EOS the tokenizer's."""
  with _VOCABS_LOCK:
    per = _VOCABS.setdefault(tok, {})
    if n_vocab not in per:
      per[n_vocab] = _build_vocabulary(tok, n_vocab)
    return per[n_vocab]


def _build_vocabulary(tok, n_vocab: int):
  llg = _llg()
  name, blob = tok.file()
  if name == "tokenizer.json":  # llguidance reads Hugging Face tokenizers itself
    return llg.LLTokenizer(blob.decode("utf-8"), n_vocab=n_vocab, eos_token=tok.eos_id)
  pieces = tok.token_bytes() + [None] * max(0, n_vocab - tok.vocab_size)  # padded model vocabularies
  special = [i for i, b in enumerate(pieces) if b is None]
  tokens = [b"\xff" + f"<[{i}]>".encode() if b is None else b for i, b in enumerate(pieces)]

  class _Wrapped:
    eos_token_id = tok.eos_id
    bos_token_id = tok.bos_id
    special_token_ids = special

    def __init__(self):
      self.tokens = tokens

    def __call__(self, text):
      return tok.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)

  return llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped()), n_vocab=n_vocab, eos_token=tok.eos_id)


def bitmask_words(n_vocab: int) -> int:
  """32-bit words in one row's token bitmask."""
  return (n_vocab + 31) // 32


class Constraint:
  """One request's grammar state: the matcher over the tokens committed so far.

  `end_ids`: tokens that end the output when the grammar is complete (EOS,
  and a chat template's end-of-turn token); the engine writes EOS there."""

  def __init__(self, grammar: Grammar, vocab, end_ids: Sequence[int], *, policy: str = "bridge"):
    if policy not in ACCEPT_POLICIES:
      raise ValueError(f"policy must be one of {ACCEPT_POLICIES}, got {policy!r}")
    llg = _llg()
    self.grammar, self.policy = grammar, policy
    self.end_ids = frozenset(int(i) for i in end_ids)
    self._matcher = llg.LLMatcher(vocab, grammar.source, log_level=0)
    if self._matcher.is_error():
      raise GrammarError(f"cannot compile: {self._matcher.get_error().strip()}", grammar.field)
    self._words = bitmask_words(vocab.vocab_size)
    self.ended = False
    self.committed = 0

  def allowed(self) -> np.ndarray:
    """The bitmask [words] uint32 of tokens the grammar allows next (bit v%32
    of word v//32); EOS once the grammar is complete."""
    if self._matcher.is_error():
      raise RuntimeError(f"grammar matcher failed: {self._matcher.get_error()}")
    mask = np.frombuffer(self._matcher.compute_bitmask(), np.uint32)
    if mask.shape[0] < self._words:
      mask = np.concatenate([mask, np.zeros(self._words - mask.shape[0], np.uint32)])
    return mask[:self._words].copy()

  def accept(self, proposals: Sequence[int], picked: Sequence[bool] | None = None) -> list[int]:
    """Commits a prefix of `proposals` (one pass's tokens from the first
    undecided column to the block's end, the first drawn under `allowed()`)
    and returns it; `picked[i]`: the refinement rule would commit proposal i
    (None: all of them). Within the grammatical prefix, policy "confident"
    takes the picks leading from the cursor, "bridge" everything up to the
    last pick, "valid" all of it; never fewer than the first token. Sets
    `ended` when the output is complete (an end token proposed where the
    grammar may end, or nothing more allowed)."""
    proposals = [int(t) for t in proposals]
    if not proposals or self.ended:
      return []
    picked = [True] * len(proposals) if picked is None else [bool(p) for p in picked[:len(proposals)]]
    m = self._matcher
    if self.policy == "valid":
      limit = len(proposals)
    elif self.policy == "confident":
      limit = next((i for i, p in enumerate(picked) if not p), len(picked))
    else:  # bridge: through the last pick the grammar would accept
      grammatical = m.validate_tokens(proposals)
      limit = max((i + 1 for i, p in enumerate(picked[:grammatical]) if p), default=0)
    n = m.try_consume_tokens(proposals[:max(1, limit)])
    taken = proposals[:n]
    if n < len(proposals) and proposals[n] in self.end_ids and m.is_accepting() and (
        self.policy == "valid" or picked[n] or n == 0):  # an end the policy would take
      self.ended = True
    elif m.is_stopped():
      self.ended = True
    elif not taken:
      raise RuntimeError(f"the proposal {proposals[0]} at the constrained column is not allowed by the grammar")
    self.committed += len(taken)
    return taken

  def forced(self, room: int) -> list[int]:
    """Tokens the grammar forces next (at most `room`), consumed: committed
    without asking the model (`{"` of an object whose first key is required)."""
    if self.ended or room <= 0:
      return []
    ff = list(self._matcher.compute_ff_tokens())[:room]
    n = self._matcher.try_consume_tokens(ff) if ff else 0
    self.committed += n
    if self._matcher.is_stopped():
      self.ended = True
    return ff[:n]


__all__ = ["ACCEPT_POLICIES", "Constraint", "Grammar", "GrammarError", "JSON_LAYOUT", "LAYOUTS", "MODEL_LAYOUT",
           "bitmask_words", "vocabulary"]
