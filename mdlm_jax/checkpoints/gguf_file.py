"""GGUF files (llama.cpp, Ollama) read as checkpoints, with llama.cpp's own `gguf` reader.

The metadata becomes the config.json keys of the family that
`general.architecture` names (checkpoints/families.py), every tensor is
dequantized to float32 by `gguf` (any type it implements: F32, F16, BF16, Q8_0,
Q4_0/1, Q5_0/1, the K quants, ...), llama.cpp's names map through the family's
table, and then the Hugging Face import path (`interop.convert`) builds and
checks our params, so a GGUF and a folder of the same model load alike.

Two differences from a Hugging Face folder are undone here: llama.cpp stores a
Llama's q/k rows interleaved for its adjacent-pair RoPE (its converter's
`permute`), and the tokenizer is metadata, not tokenizer.json
(data/gguf_tokenizer.py). A file without `output.weight` has a tied head.

`gguf`'s reader parses every metadata field up front, a vocabulary's 100K
strings included: seconds a load. A GGUF in the model cache (the registry's
fetched files) keeps an index beside it, `<file>.index.json` (the config, the
tokenizer, the chat template and where each tensor's bytes lie), so later
loads read the tensors straight from the file; the index holds the file's
size and modification time and is rebuilt when either differs.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections
import numpy as np

from mdlm_jax.checkpoints import families, interop
from mdlm_jax.checkpoints.families import InteropError
from mdlm_jax.data import gguf_tokenizer
from mdlm_jax.data.hf_tokenizer import HFTokenizer

SUFFIX = ".gguf"
MAGIC = b"GGUF"


def is_gguf(path: str) -> bool:
  """A file that starts with the GGUF magic (any name), or a path ending in .gguf."""
  if os.path.isfile(path):
    with open(path, "rb") as f:
      return f.read(4) == MAGIC
  return path.endswith(SUFFIX)


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise InteropError("reading GGUF files needs the gguf package: pip install gguf") from None
  return gguf


def _value(reader, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
  """The inverse of llama.cpp's convert `permute`: rows [heads * head_dim, ...] from its
  interleaved (x0, x_{k/2}, x1, ...) order per head back to the rotate-half order."""
  return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's convert `permute` (for writing test files): rotate-half rows -> interleaved."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(reader, arch: str, tensor_names: set[str], source: str) -> dict:
  """The config.json keys of the GGUF metadata (llama.cpp's `{arch}.*` keys)."""
  def need(key):
    value = _value(reader, f"{arch}.{key}")
    if value is None:
      raise InteropError(f"{source}: metadata {arch}.{key} is missing")
    return value

  heads = int(need("attention.head_count"))
  d = int(need("embedding_length"))
  head_dim = int(_value(reader, f"{arch}.attention.key_length", d // heads))
  value_dim = int(_value(reader, f"{arch}.attention.value_length", head_dim))
  rope_dim = int(_value(reader, f"{arch}.rope.dimension_count", head_dim))
  if value_dim != head_dim:
    raise InteropError(f"{source}: {arch}.attention.value_length={value_dim} differs from key_length={head_dim}")
  if rope_dim != head_dim:
    raise InteropError(f"{source}: {arch}.rope.dimension_count={rope_dim} rotates part of each head"
                       f" (head_dim {head_dim}); partial RoPE is not supported")
  hf = {"hidden_size": d, "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(_value(reader, f"{arch}.attention.head_count_kv", heads)),
        "intermediate_size": int(need("feed_forward_length")), "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_value(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names}
  kind = _value(reader, f"{arch}.rope.scaling.type", "none")
  if kind not in ("none", "linear", "yarn"):
    raise InteropError(f"{source}: {arch}.rope.scaling.type={kind!r} is not supported (none, linear, yarn)")
  if kind != "none":
    scaling = {"rope_type": kind, "factor": float(need("rope.scaling.factor"))}
    original = _value(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and original:
      scaling["original_max_position_embeddings"] = int(original)
    hf["rope_scaling"] = scaling
  return hf


def _tokenizer_parts(reader, source: str) -> tuple[str, dict]:
  """(tokenizer.json text, the special ids) of the file's vocabulary metadata."""
  model = _value(reader, "tokenizer.ggml.model")
  if model != "gpt2":
    raise InteropError(f"{source}: tokenizer.ggml.model={model!r} is not supported (byte-level BPE, 'gpt2', is)")
  tokens = list(_value(reader, "tokenizer.ggml.tokens", []))
  try:
    text = gguf_tokenizer.tokenizer_json(tokens, list(_value(reader, "tokenizer.ggml.token_type", [])),
                                         list(_value(reader, "tokenizer.ggml.merges", [])),
                                         str(_value(reader, "tokenizer.ggml.pre", "gpt-2")), source)
  except ValueError as e:
    raise InteropError(str(e)) from None
  ids = {f"{name}_token_id": _value(reader, f"tokenizer.ggml.{key}_token_id")
         for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("mask", "mask"))}
  ids = {k: None if v is None else int(v) for k, v in ids.items()}
  ids["add_bos"] = bool(_value(reader, "tokenizer.ggml.add_bos_token", False))
  return text, ids


def _tokenizer(text: str, ids: dict, template: str, source: str) -> HFTokenizer:
  try:
    return HFTokenizer(text, ids, source=source, spare_mask=template)
  except ValueError as e:
    raise InteropError(str(e)) from None


def chat_template_of(path: str) -> str | None:
  """`tokenizer.chat_template` of a GGUF file (its metadata only)."""
  index = _load_index(path)
  if index is not None:
    return index["template"]
  try:
    return _value(_gguf().GGUFReader(path), "tokenizer.chat_template")
  except Exception:  # pylint: disable=broad-except  # `read` reports what is wrong with the file
    return None


def index_path(path: str) -> str | None:
  """Where the index of a GGUF in the model cache lies (None for a file elsewhere:
  a user's own files get no writes beside them)."""
  from mdlm_jax.checkpoints import registry  # pylint: disable=import-outside-toplevel
  real, cache = os.path.realpath(path), os.path.realpath(registry.cache_dir())
  return f"{path}{INDEX_SUFFIX}" if os.path.commonpath([real, cache]) == cache else None


INDEX_SUFFIX = ".index.json"
_INDEX_VERSION = 1


def _stamp(path: str) -> dict:
  st = os.stat(path)
  return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _load_index(path: str) -> dict | None:
  """The file's index where it has a current one."""
  where = index_path(path)
  if where is None or not os.path.isfile(where):
    return None
  try:
    with open(where, encoding="utf-8") as f:
      index = json.load(f)
  except (OSError, ValueError):
    return None  # unreadable: parsed again and rewritten
  current = isinstance(index, dict) and index.get("version") == _INDEX_VERSION and index.get("stamp") == _stamp(path)
  return index if current else None


def _save_index(path: str, index: dict) -> None:
  """Written whole or not at all; a cache folder that refuses it costs the next load the parse."""
  where = index_path(path)
  if where is None:
    return
  tmp = f"{where}.tmp-{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(index, f)
    os.replace(tmp, where)
  except OSError:
    if os.path.exists(tmp):
      os.remove(tmp)


def _parse(path: str, gguf) -> tuple[dict, dict]:
  """(the index of the file, its tensors' raw bytes by name) through `gguf`'s reader."""
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except  # gguf raises ValueError, struct.error, IndexError...
    raise InteropError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); is it truncated?") from None
  arch = str(_value(reader, "general.architecture", ""))
  _family(arch, path)
  hf = _hf_config(reader, arch, {t.name for t in reader.tensors}, path)
  template = _value(reader, "tokenizer.chat_template")
  text, ids = _tokenizer_parts(reader, path)
  tensors = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(n) for n in reversed(t.shape)],
              "offset": int(t.data_offset), "bytes": int(t.n_bytes)} for t in reader.tensors]
  index = {"version": _INDEX_VERSION, "stamp": _stamp(path), "arch": arch, "hf": hf, "template": template,
           "tokenizer": text, "ids": ids, "tensors": tensors}
  return index, {t.name: t.data for t in reader.tensors}


def _family(arch: str, path: str):
  family = families.by_gguf_arch(arch)
  if family is None:
    supported = sorted(f.gguf_arch for f in families.FAMILIES.values() if f.gguf_arch)
    raise InteropError(f"{path}: general.architecture={arch!r} is not supported (supported: {', '.join(supported)})")
  return family


def read(path: str) -> tuple[ml_collections.ConfigDict, HFTokenizer, dict[str, np.ndarray], int, str | None]:
  """(our config, tokenizer, named float32 native params, step 0, chat template) of a GGUF file.

  InteropError names what is wrong: a missing or truncated file, an architecture
  or quantization type that is not supported, metadata that disagrees with the
  tensors."""
  if not os.path.isfile(path):
    raise InteropError(f"{path}: no such file")
  gguf = _gguf()
  index = _load_index(path)
  parsed = index is None
  if parsed:
    index, raw = _parse(path, gguf)
  else:  # each tensor's bytes straight from the file, where the index says they lie
    data = np.memmap(path, dtype=np.uint8, mode="r")
    raw = {t["name"]: data[t["offset"]:t["offset"] + t["bytes"]] for t in index["tensors"]}
  arch, hf = index["arch"], dict(index["hf"])
  family = _family(arch, path)
  template = index["template"]
  tok = _tokenizer(index["tokenizer"], index["ids"], template or "", path)
  hf["vocab_size"] = tok.vocab_size
  to_hf = {}
  for pattern, gguf_name in families.GGUF_NAMES.items():
    for i in range(hf["num_hidden_layers"]) if "{i}" in pattern else [None]:
      to_hf[gguf_name.replace("{i}", str(i))] = family.names[pattern].replace("{i}", str(i))
  unknown = sorted({t["name"] for t in index["tensors"]} - set(to_hf))
  if unknown:
    raise InteropError(f"{path}: unexpected tensors {unknown[:3]}{'...' if len(unknown) > 3 else ''}")
  tensors = {}
  for t in index["tensors"]:
    name, qtype = t["name"], gguf.GGMLQuantizationType(t["type"])
    try:
      a = gguf.quants.dequantize(raw[name], qtype)
    except NotImplementedError:
      raise InteropError(f"{path}: tensor {name} is {qtype.name}, which gguf cannot dequantize") from None
    except ValueError as e:
      raise InteropError(f"{path}: tensor {name} ({qtype.name}) is malformed: {e}") from None
    a = np.asarray(a, np.float32).reshape(t["shape"])
    if family.gguf_permuted_qk and name.split(".")[-2] in ("attn_q", "attn_k"):
      heads = hf["num_attention_heads"] if name.split(".")[-2] == "attn_q" else hf["num_key_value_heads"]
      if a.shape[0] % (2 * heads):
        raise InteropError(f"{path}: tensor {name} has {a.shape[0]} rows, not a whole number of {heads} heads")
      a = unpermute_qk(a, heads)
    tensors[to_hf[name]] = a
  config, tok, named, step = interop.convert(family.name, hf, tensors, tok, path)
  if parsed:
    _save_index(path, index)  # parsed and converted without error: later loads skip the parse
  return config, tok, named, step, template
