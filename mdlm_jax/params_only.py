"""Params-only checkpoints: what inference needs and nothing else.

A folder with three files, each readable without this package:
  config.json        {"format", "version", "step", "dtype", "config", ...}
  tokenizer.model    the sentencepiece model proto
  model.safetensors  one tensor per parameter, named by its path ("blocks.0.attn.wq")
Training checkpoints carry optimizer state and float32 weights (about 4x the
bytes); this is the shape the packaged default models ship in. The folder is
written under a temporary name and renamed into place, so a reader never sees
half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import jax
import ml_collections
import numpy as np

from mdlm_jax import safetensors

FORMAT = "mdlm_jax.params"
VERSION = 1
FILES = ("config.json", "tokenizer.model", "model.safetensors")
DTYPES = ("float32", "bfloat16")


class ParamsFileError(ValueError):
  """A params-only folder that is incomplete or does not match its config."""


def is_params_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(
      os.path.join(path, "model.safetensors"))


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


def save(out: str, params: Any, config: ml_collections.ConfigDict, tokenizer_bytes: bytes, *, step: int,
         dtype: str = "bfloat16", extra: dict | None = None, overwrite: bool = False) -> str:
  """Writes the folder `out` atomically; returns its path."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
  out = os.path.abspath(out)
  if os.path.exists(out) and not overwrite:
    raise FileExistsError(f"{out} already exists (pass overwrite to replace it)")
  np_dtype = np.dtype(jax.numpy.dtype(dtype))
  tensors = {k: np.asarray(jax.device_get(v)).astype(np_dtype) for k, v in flatten(params).items()}
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".tmp-{os.path.basename(out)}-")
  try:
    safetensors.save(os.path.join(tmp, "model.safetensors"), tensors, {"format": FORMAT})
    with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
      f.write(tokenizer_bytes)
    meta = {"format": FORMAT, "version": VERSION, "step": int(step), "dtype": dtype,
            "num_params": int(sum(a.size for a in tensors.values())),
            "config": json.loads(config.to_json_best_effort()), **(extra or {})}
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(meta, f, indent=1, sort_keys=True)
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
  return out


def read(path: str) -> tuple[dict, bytes, dict[str, np.ndarray]]:
  """(meta from config.json, tokenizer bytes, named float32 arrays)."""
  for name in FILES:
    if not os.path.isfile(os.path.join(path, name)):
      raise ParamsFileError(f"{path}: params-only checkpoint lacks {name}")
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
  with open(os.path.join(path, "tokenizer.model"), "rb") as f:
    tok = f.read()
  tensors, _ = safetensors.load(os.path.join(path, "model.safetensors"))
  return meta, tok, {k: v.astype(np.float32) for k, v in tensors.items()}
