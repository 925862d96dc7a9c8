"""Hugging Face `tokenizers` models (tokenizer.json), as shipped by LLaDA and Dream.

A tokenizer.json does not say which token is the diffusion mask, and its BOS,
EOS and PAD are conventions of the model, not of the file: they come from the
checkpoint's config.json (tokenizer_config.json as a fallback) and travel with
the file. The vocab is the model's embedding rows, which may exceed the
tokenizer's own ids (releases pad it to a round size): those extra ids decode to
nothing. `tokenizers` is imported only when one is built (the `interop` extra).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mdlm_jax.data.tokenizer import HF_MAGIC as MAGIC, checked_ids

SPECIALS = ("mask", "bos", "eos", "pad")
FILE = "tokenizer.json"


def _tokenizers():
  try:
    import tokenizers  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError("reading a Hugging Face tokenizer.json needs the tokenizers package:"
                     " pip install 'mdlm_jax[interop]'") from None
  return tokenizers


def _as_id(value, key: str, source: str) -> int | None:
  first = value[0] if isinstance(value, (list, tuple)) and value else value  # several eos ids: the first stops us
  if first is None or first == []:
    return None
  if not isinstance(first, int) or isinstance(first, bool):
    raise ValueError(f"{source}: {key}={value!r} is not an integer")
  return first


def spare_special_id(tk, taken: set[int], avoid: str = "") -> int | None:
  """The highest special token id that is not in `taken` and whose text does not
  occur in `avoid` (the chat template): an AR vocabulary's [MASK] when it has
  none. Such a token (a repository or notebook marker of a code model's
  pretraining) appears in no chat and no answer, so reusing it costs the model
  nothing it is asked for; samplers never propose it."""
  for i, added in sorted(tk.get_added_tokens_decoder().items(), reverse=True):
    if added.special and i not in taken and added.content not in avoid:
      return i
  return None


class HFTokenizer:
  """tokenizer.json plus the model's special ids: the interface of tokenizer.Tokenizer."""

  def __init__(self, tokenizer_json: str, ids: Mapping[str, Any], source: str = FILE,
               spare_mask: str | None = None):
    """`ids`: {name}_token_id for mask, bos, eos and pad, or failing one, {name}_token
    (its text, as tokenizer_config.json gives it); PAD defaults to EOS. An optional
    vocab_size (the model's rows) may exceed the tokenizer's own ids; add_bos
    (default true): whether the model's prompts start with BOS (`adds_bos`).
    `spare_mask` (an AR model's chat template, or ""): with no mask token named,
    [MASK] is a special token the model has no other use for (`spare_special_id`)."""
    try:
      self._tk = _tokenizers().Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON  # pylint: disable=broad-except
      raise ValueError(f"{source}: not a Hugging Face tokenizer.json ({e})") from None
    self._json = tokenizer_json
    own = max(self._tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    vocab = _as_id(ids.get("vocab_size"), "vocab_size", source)
    self._vocab = own if vocab is None else vocab
    if self._vocab < own:
      raise ValueError(f"{source}: vocab_size {self._vocab} is smaller than the tokenizer's {own} ids")
    got: dict[str, int | None] = {}
    for name in SPECIALS:
      i = _as_id(ids.get(f"{name}_token_id"), f"{name}_token_id", source)
      token = ids.get(f"{name}_token")
      token = token.get("content") if isinstance(token, dict) else token  # transformers' AddedToken form
      got[name] = self._tk.token_to_id(token) if i is None and isinstance(token, str) else i
    got["pad"] = got["eos"] if got["pad"] is None else got["pad"]
    if spare_mask is not None and got["bos"] is None:  # an AR model without BOS (Qwen): prompts start bare
      got["bos"], ids = got["eos"], {**ids, "add_bos": False}
    if got["mask"] is None and spare_mask is not None:
      got["mask"] = spare_special_id(self._tk, {i for i in got.values() if i is not None} | {self.unk_id}, spare_mask)
    for name, i in got.items():
      if i is None:
        raise ValueError(f"{source}: no {name}_token_id in config.json (nor a known {name}_token in"
                         " tokenizer_config.json); mdlm_jax needs it")
      if not 0 <= i < self._vocab:
        raise ValueError(f"{source}: {name}_token_id={i} is outside the vocab [0, {self._vocab})")
    if got["mask"] in (got["bos"], got["eos"], got["pad"]):
      raise ValueError(f"{source}: mask_token_id={got['mask']} is also the bos, eos or pad id")
    self._ids: dict[str, int] = got  # type: ignore[assignment]
    # Whether each id is one of ours, as a table: a decode reads it per id (np.isin took longer than the decode).
    self._ours = np.zeros(self._vocab, bool)
    self._ours[sorted(set(got.values()))] = True
    add_bos = ids.get("add_bos", True)
    if not isinstance(add_bos, bool):
      raise ValueError(f"{source}: add_bos={add_bos!r} is not true or false")
    self.adds_bos = add_bos

  @classmethod
  def from_file(cls, path: str | os.PathLike, ids: Mapping[str, Any], spare_mask: str | None = None) -> HFTokenizer:
    path = os.fspath(path)
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except FileNotFoundError:
      raise FileNotFoundError(f"tokenizer file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: cannot read the tokenizer ({e})") from None
    return cls(text, ids, source=path, spare_mask=spare_mask)

  @classmethod
  def from_hf_folder(cls, path: str, config: Mapping[str, Any], tokenizer_path: str | None = None,
                     vocab_size: int | None = None, spare_mask: str | None = None) -> HFTokenizer:
    """The tokenizer.json of a LLaDA/Dream folder, special ids from its config.json
    (`config`) or else the token texts of its tokenizer_config.json."""
    ids: dict[str, Any] = {}
    try:
      with open(os.path.join(path, "tokenizer_config.json")) as f:
        extra = json.load(f)
      if isinstance(extra, dict):
        ids.update({f"{n}_token": extra.get(f"{n}_token") for n in SPECIALS})
        if spare_mask is not None:  # an AR model: BOS as its tokenizer adds it (LLaDA/Dream prompts always have it)
          ids["add_bos"] = extra.get("add_bos_token") is True
    except (OSError, ValueError):
      pass  # optional: config.json usually has the ids
    ids.update({f"{n}_token_id": config.get(f"{n}_token_id") for n in SPECIALS})
    return cls.from_file(tokenizer_path or os.path.join(path, FILE), {**ids, "vocab_size": vocab_size},
                         spare_mask=spare_mask)

  @classmethod
  def from_bytes(cls, data: bytes) -> HFTokenizer:
    if not data.startswith(MAGIC):
      raise ValueError("not a serialized HFTokenizer (missing its header)")
    header, _, body = data[len(MAGIC):].partition(b"\n")
    try:
      ids = json.loads(header)
      text = body.decode("utf-8")
    except ValueError as e:
      raise ValueError(f"serialized HFTokenizer is corrupt ({e})") from None
    return cls(text, ids, source="<serialized tokenizer.json>")

  def to_bytes(self) -> bytes:
    """Header line of special ids, then tokenizer.json verbatim: one blob for checkpoint metadata."""
    return MAGIC + json.dumps(self.meta(), sort_keys=True).encode() + b"\n" + self._json.encode("utf-8")

  def __reduce__(self):
    return (HFTokenizer.from_bytes, (self.to_bytes(),))

  def meta(self) -> dict[str, int]:
    """The special ids and vocab size that go beside tokenizer.json (in config.json)."""
    return {**self.special_ids(), "vocab_size": self._vocab, "add_bos": self.adds_bos}

  def special_ids(self) -> dict[str, int]:
    return {f"{n}_token_id": self._ids[n] for n in SPECIALS}

  def file(self) -> tuple[str, bytes]:
    """(file name, contents) of the tokenizer in a checkpoint folder."""
    return FILE, self._json.encode("utf-8")

  @property
  def vocab_size(self) -> int:
    return self._vocab

  @property
  def mask_id(self) -> int:
    return self._ids["mask"]

  @property
  def bos_id(self) -> int:
    return self._ids["bos"]

  @property
  def eos_id(self) -> int:
    return self._ids["eos"]

  @property
  def pad_id(self) -> int:
    return self._ids["pad"]

  @property
  def unk_id(self) -> int:
    """-1 when the model has none (byte-level BPE never needs one)."""
    token = getattr(self._tk.model, "unk_token", None)
    i = self._tk.token_to_id(token) if isinstance(token, str) else None
    return -1 if i is None else i

  def encode(self, text: str) -> list[int]:
    """Token ids of text, without BOS/EOS (no post-processor templates)."""
    return self._tk.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text of a 1-D id sequence; our special ids and the tokenizer's special tokens vanish."""
    ids = checked_ids(ids, self._vocab)
    return self._tk.decode(ids[~self._ours[ids]].tolist(), skip_special_tokens=True)

  def piece_id(self, piece: str) -> int:
    """The id of a whole token (a chat or FIM marker); ValueError if the
    vocabulary has no such token."""
    i = self._tk.token_to_id(piece)
    if i is None:
      raise ValueError(f"the tokenizer has no token {piece!r}")
    return i

  def piece(self, token_id: int) -> str:
    """The vocabulary token of one id ("" for the model's padding rows)."""
    return self._tk.id_to_token(int(token_id)) or ""
