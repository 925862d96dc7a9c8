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
"""

from __future__ import annotations

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


def _tokenizer(reader, template: str, source: str) -> HFTokenizer:
  model = _value(reader, "tokenizer.ggml.model")
  if model != "gpt2":
    raise InteropError(f"{source}: tokenizer.ggml.model={model!r} is not supported (byte-level BPE, 'gpt2', is)")
  tokens = list(_value(reader, "tokenizer.ggml.tokens", []))
  try:
    text = gguf_tokenizer.tokenizer_json(tokens, list(_value(reader, "tokenizer.ggml.token_type", [])),
                                         list(_value(reader, "tokenizer.ggml.merges", [])),
                                         str(_value(reader, "tokenizer.ggml.pre", "gpt-2")), source)
    ids = {f"{name}_token_id": _value(reader, f"tokenizer.ggml.{key}_token_id")
           for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("mask", "mask"))}
    ids["add_bos"] = bool(_value(reader, "tokenizer.ggml.add_bos_token", False))
    return HFTokenizer(text, ids, source=source, spare_mask=template)
  except ValueError as e:
    raise InteropError(str(e)) from None


def chat_template_of(path: str) -> str | None:
  """`tokenizer.chat_template` of a GGUF file (its metadata only)."""
  try:
    return _value(_gguf().GGUFReader(path), "tokenizer.chat_template")
  except Exception:  # pylint: disable=broad-except  # `read` reports what is wrong with the file
    return None


def read(path: str) -> tuple[ml_collections.ConfigDict, HFTokenizer, dict[str, np.ndarray], int, str | None]:
  """(our config, tokenizer, named float32 native params, step 0, chat template) of a GGUF file.

  InteropError names what is wrong: a missing or truncated file, an architecture
  or quantization type that is not supported, metadata that disagrees with the
  tensors."""
  if not os.path.isfile(path):
    raise InteropError(f"{path}: no such file")
  gguf = _gguf()
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except  # gguf raises ValueError, struct.error, IndexError...
    raise InteropError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); is it truncated?") from None
  arch = str(_value(reader, "general.architecture", ""))
  family = families.by_gguf_arch(arch)
  if family is None:
    supported = sorted(f.gguf_arch for f in families.FAMILIES.values() if f.gguf_arch)
    raise InteropError(f"{path}: general.architecture={arch!r} is not supported (supported: {', '.join(supported)})")
  by_gguf = {t.name: t for t in reader.tensors}
  hf = _hf_config(reader, arch, set(by_gguf), path)
  template = _value(reader, "tokenizer.chat_template")
  tok = _tokenizer(reader, template or "", path)
  hf["vocab_size"] = tok.vocab_size
  to_hf = {}
  for pattern, gguf_name in families.GGUF_NAMES.items():
    for i in range(hf["num_hidden_layers"]) if "{i}" in pattern else [None]:
      to_hf[gguf_name.replace("{i}", str(i))] = family.names[pattern].replace("{i}", str(i))
  unknown = sorted(set(by_gguf) - set(to_hf))
  if unknown:
    raise InteropError(f"{path}: unexpected tensors {unknown[:3]}{'...' if len(unknown) > 3 else ''}")
  tensors = {}
  for name, t in by_gguf.items():
    try:
      a = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise InteropError(f"{path}: tensor {name} is {t.tensor_type.name}, which gguf cannot dequantize") from None
    except ValueError as e:
      raise InteropError(f"{path}: tensor {name} ({t.tensor_type.name}) is malformed: {e}") from None
    a = np.asarray(a, np.float32).reshape([int(n) for n in reversed(t.shape)])
    if family.gguf_permuted_qk and name.split(".")[-2] in ("attn_q", "attn_k"):
      heads = hf["num_attention_heads"] if name.split(".")[-2] == "attn_q" else hf["num_key_value_heads"]
      if a.shape[0] % (2 * heads):
        raise InteropError(f"{path}: tensor {name} has {a.shape[0]} rows, not a whole number of {heads} heads")
      a = unpermute_qk(a, heads)
    tensors[to_hf[name]] = a
  config, tok, named, step = interop.convert(family.name, hf, tensors, tok, path)
  return config, tok, named, step, template
