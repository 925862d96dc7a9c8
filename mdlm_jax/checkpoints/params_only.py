"""Params-only checkpoints: what inference needs and nothing else.

A folder with three kinds of file, each readable without this package:
  config.json        {"format", "version", "step", "dtype", "config", ...}
  tokenizer.model    the sentencepiece model proto, or
  tokenizer.json     a Hugging Face tokenizer (an imported LLaDA/Dream model's); its special
                     ids and the vocab size are config.json's "tokenizer" entry (version 2)
  model.safetensors  one tensor per parameter, named by its path ("blocks.0.attn.wq"),
                     or, past --max-shard-size, model-0000i-of-0000n.safetensors shards
                     with a model.safetensors.index.json (the Hugging Face layout)
Training checkpoints carry optimizer state and float32 weights (about 4x the
bytes); this is the shape the packaged default models ship in. The folder is
written under a temporary name and renamed into place, so a reader never sees
half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import jax
import ml_collections
import numpy as np

from mdlm_jax.data import hf_tokenizer
from mdlm_jax.checkpoints import safetensors
from mdlm_jax.data.hf_tokenizer import HFTokenizer
from mdlm_jax.data.tokenizer import Tokenizer

FORMAT = "mdlm_jax.params"
VERSION = 2  # 2: tokenizer.json folders; sentencepiece ones are still written as 1
DEFAULT_MAX_SHARD = 5 * 10**9
DTYPES = ("float32", "bfloat16")


class ParamsFileError(ValueError):
  """A params-only folder that is incomplete or does not match its config."""


def is_params_dir(path: str) -> bool:
  """A folder with config.json and safetensors weights that is not a Hugging Face
  (LLaDA/Dream) export, whose config.json names a model_type instead."""
  if not (os.path.isfile(os.path.join(path, "config.json")) and safetensors.has_weights(path)):
    return False
  try:
    with open(os.path.join(path, "config.json")) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return True  # `read` says what is wrong with it
  return not (isinstance(meta, dict) and "model_type" in meta)


@contextlib.contextmanager
def atomic_folder(out: str, overwrite: bool) -> Iterator[str]:
  """Yields a temporary folder beside `out` to fill; on success it replaces `out`
  in one rename, on any error it is removed, so a reader never sees half a folder."""
  out = os.path.abspath(out)
  if os.path.exists(out) and not overwrite:
    raise FileExistsError(f"{out} already exists (pass overwrite to replace it)")
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".tmp-{os.path.basename(out)}-")
  try:
    yield tmp
    os.chmod(tmp, 0o777 & ~safetensors.current_umask())  # mkdtemp makes it 0700
    if os.path.exists(out):
      trash = tempfile.mkdtemp(dir=parent, prefix=f".old-{os.path.basename(out)}-")
      os.replace(out, os.path.join(trash, "old"))
      os.replace(tmp, out)
      shutil.rmtree(trash)
    else:
      os.replace(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _name(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flatten(tree: Any) -> dict[str, Any]:
  """{dotted parameter path: leaf} of a pure params dict."""
  return {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten_like(abstract: Any, named: dict[str, np.ndarray], source: str) -> Any:
  """Rebuilds `abstract`'s structure from named arrays, checking names and shapes."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  want = {_name(p): leaf for p, leaf in paths}
  missing = sorted(set(want) - set(named))
  extra = sorted(set(named) - set(want))
  if missing or extra:
    raise ParamsFileError(f"{source}: parameters do not match the config"
                          f" (missing {missing[:3]}{'...' if len(missing) > 3 else ''},"
                          f" unexpected {extra[:3]}{'...' if len(extra) > 3 else ''})")
  leaves = []
  for name, leaf in want.items():
    a = named[name]
    if tuple(a.shape) != tuple(leaf.shape):
      raise ParamsFileError(f"{source}: parameter {name} has shape {tuple(a.shape)}, the config gives"
                            f" {tuple(leaf.shape)}")
    leaves.append(a)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def is_adapter_name(name: str) -> bool:
  """A low-rank adapter's parameter path (model.lora_rank)."""
  return any(part.startswith("lora_") for part in name.split("."))


def save(out: str, params: Any, config: ml_collections.ConfigDict, tokenizer: Tokenizer | HFTokenizer, *, step: int,
         dtype: str = "bfloat16", extra: dict | None = None, overwrite: bool = False,
         max_shard_bytes: int = DEFAULT_MAX_SHARD, chat_template: str | None = None, base: str | None = None) -> str:
  """Writes the folder `out` atomically (with `chat_template.jinja` when the
  model has a chat template); returns its path. With `base` (a checkpoint
  path or registry name holding every other weight, unchanged), only the
  adapters are written: the folder is the adaptation, megabytes, and loading
  it reads `base` too."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  np_dtype = np.dtype(jax.numpy.dtype(dtype))
  named = flatten(params)
  if base is not None:
    named = {k: v for k, v in named.items() if is_adapter_name(k)}
    if not named:
      raise ValueError("an adapters-only folder needs a model with adapters (model.lora_rank > 0)")
    extra = {**(extra or {}), "base": base}
  tensors = {k: np.asarray(jax.device_get(v)).astype(np_dtype) for k, v in named.items()}
  with atomic_folder(out, overwrite) as tmp:
    safetensors.save_folder(tmp, tensors, max_shard_bytes=max_shard_bytes, metadata={"format": FORMAT})
    name, data = tokenizer.file()
    with open(os.path.join(tmp, name), "wb") as f:
      f.write(data)
    hf = isinstance(tokenizer, HFTokenizer)
    meta = {"format": FORMAT, "version": VERSION if hf else 1, "step": int(step), "dtype": dtype,
            "num_params": int(sum(a.size for a in tensors.values())),
            "config": json.loads(config.to_json_best_effort()), **(extra or {}),
            **({"tokenizer": {"file": name, **tokenizer.meta()}} if hf else {})}
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(meta, f, indent=1, sort_keys=True)
    if chat_template is not None:
      with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(chat_template)
  return os.path.abspath(out)


def read(path: str) -> tuple[dict, Tokenizer | HFTokenizer, dict[str, np.ndarray]]:
  """(meta from config.json, tokenizer, named float32 arrays)."""
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ParamsFileError(f"{path}: params-only checkpoint lacks config.json")
  try:
    with open(os.path.join(path, "config.json")) as f:
      meta = json.load(f)
  except ValueError as e:
    raise ParamsFileError(f"{path}/config.json is not JSON ({e})") from e
  if not isinstance(meta, dict) or meta.get("format") != FORMAT or "config" not in meta:
    raise ParamsFileError(f"{path}/config.json is not a {FORMAT} file")
  if meta.get("version", 0) > VERSION:
    raise ParamsFileError(f"{path}: format version {meta['version']} is newer than this package reads"
                          f" ({VERSION}); upgrade mdlm_jax")
  tok_meta = meta.get("tokenizer")
  name = tok_meta.get("file") if isinstance(tok_meta, dict) else "tokenizer.model"
  if name not in ("tokenizer.model", hf_tokenizer.FILE):
    raise ParamsFileError(f"{path}/config.json: unknown tokenizer file {name!r}")
  if not os.path.isfile(os.path.join(path, name)):
    raise ParamsFileError(f"{path}: params-only checkpoint lacks {name}")
  if name == hf_tokenizer.FILE:
    tok = HFTokenizer.from_file(os.path.join(path, name), tok_meta)
  else:
    tok = Tokenizer.from_file(os.path.join(path, name))
  if not safetensors.has_weights(path):
    raise ParamsFileError(f"{path}: params-only checkpoint lacks model.safetensors")
  tensors, _ = safetensors.load_folder(path)
  return meta, tok, {k: v.astype(np.float32) for k, v in tensors.items()}
