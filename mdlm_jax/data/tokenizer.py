"""A lossless sentencepiece tokenizer for source code, and its CLI.

Samples are judged as code, so decode(encode(s)) must give back s byte for
byte: indentation, blank lines, tabs and any unicode. The training options in
`_TRAINER_OPTIONS` are what makes that hold; `Tokenizer.encode` covers the one
case sentencepiece cannot (a literal U+2581, its own space marker).

  python -m mdlm_jax.tokenizer train --corpus=stdlib --out=tok.model --vocab-size=4096
  python -m mdlm_jax.tokenizer encode --model=tok.model --text='print(1)'
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import sentencepiece as spm

if TYPE_CHECKING:
  from mdlm_jax.data.hf_tokenizer import HFTokenizer

MASK_PIECE = "[MASK]"
# Pieces a chat template and fill-in-the-middle training write as text and the
# model must read as one token each (ChatML turns, Qwen-style tool calls, the
# FIM sentinels of Bavarian et al. 2022). Trained as user-defined symbols:
# always one piece when they occur, and decoded back to the same text.
CHAT_AND_FIM_PIECES = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                       "</tool_response>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
# Of those, the ones a model reads and never writes: a generation ends with
# EOS or <|im_end|> and may open tool calls, but it never opens a turn, a
# tool's response or a FIM section (`never_generated`).
READ_ONLY_PIECES = ("<|im_start|>", "<tool_response>", "</tool_response>", "<|fim_prefix|>", "<|fim_suffix|>",
                    "<|fim_middle|>")
_SPACE_MARK = "\u2581"  # sentencepiece's stand-in for " ".
_META_PIECES = 5  # <unk> <s> </s> <pad> [MASK]
_MIN_VOCAB = _META_PIECES + 256 + 16  # bytes must fit, plus a few characters.
_CHUNK_CHARS = 2048  # training "sentence" size; whole lines where possible.
# Leads HFTokenizer.to_bytes(), so a checkpoint's tokenizer blob says which backend it is
# (a sentencepiece proto never starts with it: its first byte is a field tag, 0x0a).
HF_MAGIC = b"mdlm_jax.hf_tokenizer\n"

_TRAINER_OPTIONS = dict(
    model_type="bpe",  # trains 20M characters in seconds; unigram took ~40x longer.
    # Keep text exactly as written: no NFKC, no whitespace collapsing, no
    # dummy leading space (it would turn "x" into " x").
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    # Unseen characters (tabs in a tab-free corpus, emoji) become utf-8 byte
    # pieces instead of <unk>, so nothing is ever lost.
    byte_fallback=True,
    character_coverage=0.9995,  # the rarest 0.05% of characters: bytes.
    # Let pieces run across spaces, newlines and script/number boundaries:
    # "):\n        return" becomes a few tokens, ~20% fewer tokens on code
    # than sentencepiece's word-splitting defaults.
    allow_whitespace_only_pieces=True,
    split_by_whitespace=False,
    split_by_unicode_script=False,
    split_by_number=False,
    split_digits=False,
    # Tiny corpora run out of merges; accept a smaller vocab rather than fail.
    hard_vocab_limit=False,
    max_sentence_length=4 * _CHUNK_CHARS + 16,  # bytes; chunks are never dropped.
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=3,
    control_symbols=[MASK_PIECE],  # control: "[MASK]" in text stays text.
    minloglevel=2,
)


def checked_ids(ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
  """ids as a 1-D int64 array, or a ValueError naming the first bad one."""
  ids = np.asarray(ids)
  if ids.ndim != 1:
    raise ValueError(f"decode takes a 1-D id sequence, got shape {ids.shape}")
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"decode takes integer ids, got dtype {ids.dtype}")
  ids = ids.astype(np.int64)
  bad = ids[(ids < 0) | (ids >= vocab_size)]
  if bad.size:
    raise ValueError(f"token id {int(bad[0])} is outside the vocab [0, {vocab_size})")
  return ids


def load_bytes(data: bytes) -> Tokenizer | HFTokenizer:
  """Either backend from its to_bytes(): checkpoints keep one tokenizer blob, and the
  HFTokenizer one starts with HF_MAGIC."""
  if bytes(data[:len(HF_MAGIC)]) == HF_MAGIC:
    from mdlm_jax.data.hf_tokenizer import HFTokenizer  # pylint: disable=import-outside-toplevel
    return HFTokenizer.from_bytes(bytes(data))
  return Tokenizer.from_bytes(data)


class Tokenizer:
  """sentencepiece model with the special ids the diffusion model needs."""

  adds_bos = True  # our models read BOS before every prompt

  def __init__(self, proto: bytes, source: str = "<bytes>"):
    self._proto = bytes(proto)
    if self._proto.startswith(HF_MAGIC):
      raise ValueError(f"{source}: holds a Hugging Face tokenizer.json; load it with tokenizer.load_bytes")
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(self._proto)
    except (RuntimeError, OSError) as e:
      raise ValueError(f"{source}: not a sentencepiece model ({e})") from None
    self._mask_id = self._sp.piece_to_id(MASK_PIECE)
    ids = {"bos": self._sp.bos_id(), "eos": self._sp.eos_id(),
           "pad": self._sp.pad_id(), "unk": self._sp.unk_id()}
    if self._mask_id == ids["unk"] or not self._sp.is_control(self._mask_id):
      raise ValueError(f"{source}: the model has no {MASK_PIECE} control piece")
    for name, i in ids.items():
      if i < 0:
        raise ValueError(f"{source}: the model has no {name} piece")
    if len(set(ids.values()) | {self._mask_id}) != len(ids) + 1:
      raise ValueError(f"{source}: special ids are not distinct: {ids}, mask={self._mask_id}")
    self._special = np.array(sorted(set(ids.values()) | {self._mask_id}), np.int64)
    marker_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_MARK.encode()]
    self._marker_ids = marker_bytes if ids["unk"] not in marker_bytes else None

  @classmethod
  def from_bytes(cls, serialized_model_proto: bytes) -> Tokenizer:
    return cls(serialized_model_proto)

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> Tokenizer:
    path = os.fspath(path)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"tokenizer model not found: {path}")
    with open(path, "rb") as f:
      return cls(f.read(), source=path)

  def to_bytes(self) -> bytes:
    """The serialized model proto, for embedding in checkpoints."""
    return self._proto

  def file(self) -> tuple[str, bytes]:
    """(file name, contents) of the tokenizer in a checkpoint folder."""
    return "tokenizer.model", self._proto

  def special_ids(self) -> dict[str, int]:
    return {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id, "pad_token_id": self.pad_id,
            "mask_token_id": self.mask_id}

  def __reduce__(self):  # SentencePieceProcessor does not pickle by itself.
    return (Tokenizer.from_bytes, (self._proto,))

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def mask_id(self) -> int:
    return self._mask_id

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def pad_id(self) -> int:
    return self._sp.pad_id()

  @property
  def unk_id(self) -> int:
    return self._sp.unk_id()

  def encode(self, text: str) -> list[int]:
    """Token ids of text, without BOS/EOS."""
    if _SPACE_MARK not in text:
      return self._sp.encode(text)
    # sentencepiece would read a literal U+2581 as a space; spell it in bytes.
    if self._marker_ids is None:
      raise ValueError(f"this model has no byte pieces to encode {_SPACE_MARK!r}")
    ids: list[int] = []
    for i, part in enumerate(text.split(_SPACE_MARK)):
      if i:
        ids.extend(self._marker_ids)
      ids.extend(self._sp.encode(part))
    return ids

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text of a 1-D id sequence; special ids (bos/eos/pad/mask/unk) vanish."""
    ids = checked_ids(ids, self.vocab_size)
    return self._sp.decode(ids[~np.isin(ids, self._special)].tolist())

  def piece(self, token_id: int) -> str:
    """The vocabulary piece of one id, for debugging and display."""
    return self._sp.id_to_piece(int(token_id))

  def token_bytes(self) -> list[bytes | None]:
    """The bytes each id decodes to inside text, None for the special ids
    (BOS, EOS, PAD, MASK, UNK), which decode to nothing: what a grammar
    engine matches tokens by."""
    out: list[bytes | None] = []
    for i in range(self.vocab_size):
      piece = self._sp.id_to_piece(i)
      if self._sp.is_control(i) or self._sp.is_unknown(i):
        out.append(None)
      elif self._sp.is_byte(i):
        out.append(bytes([int(piece[3:5], 16)]))
      else:
        out.append(piece.replace(_SPACE_MARK, " ").encode("utf-8"))
    return out

  def piece_id(self, piece: str) -> int:
    """The id of a whole piece (a chat or FIM marker); ValueError if the
    vocabulary has no such piece."""
    i = self._sp.piece_to_id(piece)
    if i == self._sp.unk_id() and piece != self._sp.id_to_piece(i):
      raise ValueError(f"the tokenizer has no piece {piece!r}")
    return i


def never_generated(tokenizer) -> tuple[int, ...]:
  """Ids no sampler proposes: [MASK], BOS, PAD and UNK (any that is not also
  EOS), and the READ_ONLY_PIECES the vocabulary has. A model that puts high
  probability on a FIM marker inside an answer (a half-trained one does)
  would otherwise write it into the text."""
  ids = {tokenizer.mask_id, tokenizer.bos_id, tokenizer.pad_id, tokenizer.unk_id}
  for piece in READ_ONLY_PIECES:
    try:
      ids.add(tokenizer.piece_id(piece))
    except ValueError:
      pass
  return tuple(sorted(i for i in ids if i >= 0 and i != tokenizer.eos_id))


# ------------------------------------------------------------------ training


def _line_chunks(text: str) -> Iterator[str]:
  """Runs of whole lines up to _CHUNK_CHARS characters (longer lines are cut).
  Newlines stay inside the chunks so pieces can learn indentation."""
  buf: list[str] = []
  size = 0
  for line in text.splitlines(keepends=True):
    for i in range(0, len(line), _CHUNK_CHARS):
      piece = line[i:i + _CHUNK_CHARS]
      if buf and size + len(piece) > _CHUNK_CHARS:
        yield "".join(buf)
        buf, size = [], 0
      buf.append(piece)
      size += len(piece)
  if buf:
    yield "".join(buf)


def _chunks(texts: Iterable[str], max_chars: int) -> Iterator[str]:
  """Training sentences from the first max_chars characters of texts."""
  left = max_chars
  for text in texts:
    text = text[:left]
    left -= len(text)
    yield from _line_chunks(text)
    if left <= 0:
      return


def _drop_rare_chars(chunks: list[str], vocab_size: int) -> list[str]:
  """Cuts the rarest characters out of the training text when a small vocab
  cannot hold them all (sentencepiece would refuse to train). They still
  round-trip, as byte pieces."""
  counts = collections.Counter()
  for c in chunks:
    counts.update(c)
  budget = max(1, (vocab_size - _META_PIECES - 256) // 2)  # half the free slots.
  if len(counts) <= budget:
    return chunks
  rare = "".join(re.escape(ch) for ch, _ in counts.most_common()[budget:])
  splitter = re.compile(f"[{rare}]+")
  return [part for c in chunks for part in splitter.split(c) if part]


def _write_atomic(path: str, data: bytes):
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".model")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a model file is for sharing
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _check_round_trip(tok: Tokenizer, chunks: Sequence[str], limit: int = 200_000):
  """Cheap guard: a sentencepiece option drifting would corrupt data silently."""
  seen = 0
  for text in chunks:
    if tok.decode(tok.encode(text)) != text:
      raise RuntimeError(f"trained tokenizer does not round-trip: {text[:80]!r}")
    seen += len(text)
    if seen >= limit:
      return


def train_tokenizer(texts: Iterable[str], out_path: str, vocab_size: int,
                    max_chars: int = 20_000_000, user_pieces: Sequence[str] = ()) -> Tokenizer:
  """Trains a lossless BPE tokenizer on up to max_chars characters of texts,
  writes it atomically to out_path and returns it. `user_pieces` (e.g.
  `CHAT_AND_FIM_PIECES`) are always one token each.

  On a tiny corpus the vocab may come out smaller than vocab_size.
  """
  if vocab_size < _MIN_VOCAB:
    raise ValueError(
        f"vocab_size={vocab_size} is too small: byte fallback needs {_META_PIECES} "
        f"special + 256 byte pieces, so use at least {_MIN_VOCAB}")
  if max_chars < 1:
    raise ValueError(f"max_chars must be positive, got {max_chars}")
  chunks = [c for c in _chunks(texts, max_chars) if c]
  if not chunks:
    raise ValueError("no training text: every document is empty")
  sentences = _drop_rare_chars(chunks, vocab_size)
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
        num_threads=min(os.cpu_count() or 1, 8), **_TRAINER_OPTIONS,
        **({"user_defined_symbols": list(user_pieces)} if user_pieces else {}))
  except RuntimeError as e:
    raise ValueError(f"sentencepiece training failed: {e}") from None
  tok = Tokenizer.from_bytes(model.getvalue())
  _check_round_trip(tok, chunks)
  _write_atomic(out_path, tok.to_bytes())
  return tok


# ----------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
  """Usage errors as one line, like every other error of this CLI."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message}\n")


def _parse(argv: Sequence[str]) -> argparse.Namespace:
  p = _Parser(prog="python -m mdlm_jax.tokenizer", description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
  t = sub.add_parser("train", help="train a tokenizer on a corpus's train split")
  t.add_argument("--corpus", required=True, help="'stdlib', a directory, a glob or a .jsonl file")
  t.add_argument("--out", required=True, help="path of the .model file to write")
  t.add_argument("--vocab-size", type=int, required=True)
  t.add_argument("--max-chars", type=int, default=20_000_000)
  t.add_argument("--text-field", default="text", help="jsonl field holding the text")
  t.add_argument("--validation-fraction", type=float, default=0.05,
                 help="held out of training, as in config.data.validation_fraction")
  t.add_argument("--chat-fim-pieces", action="store_true",
                 help="one token each for the chat, tool-call and fill-in-the-middle markers: "
                      + " ".join(CHAT_AND_FIM_PIECES))
  e = sub.add_parser("encode", help="print the token ids of a text")
  e.add_argument("--model", required=True)
  e.add_argument("--text", required=True)
  return p.parse_args(argv)


def _run(args: argparse.Namespace) -> str:
  if args.command == "encode":
    return " ".join(map(str, Tokenizer.from_file(args.model).encode(args.text)))
  from mdlm_jax import data  # pylint: disable=import-outside-toplevel
  start = time.time()
  docs = data.load_documents(args.corpus, "train", args.validation_fraction, args.text_field)
  tok = train_tokenizer(docs, args.out, args.vocab_size, args.max_chars,
                        CHAT_AND_FIM_PIECES if args.chat_fim_pieces else ())
  return (f"wrote {args.out}: vocab {tok.vocab_size}, trained on {len(docs)} documents "
          f"in {time.time() - start:.1f}s")


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  try:
    print(_run(args))
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0

