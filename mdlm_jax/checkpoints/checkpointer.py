"""Checkpoints: train state, data-iterator state, config and tokenizer together.

One orbax CheckpointManager step directory holds four items:
  weights: {params, ema} (sharded save/restore; all that inference reads);
  train:   {step, opt_state};
  data:    each process's grain iterator state (one JSON file per process),
           so a resume sees the next batch;
  meta:  the config, the objective and the serialized tokenizer (JSON).
Orbax writes each step to a temporary directory and renames it when complete,
so a crash mid-save never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp

from mdlm_jax import config as config_lib

ITEMS = ("weights", "train", "data", "meta")


class CheckpointError(RuntimeError):
  """A checkpoint that is missing or cannot be read; the message says where."""


def _manager(directory: str, *, keep: int = 3, create: bool = True, read_only: bool = False):
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, read_only=read_only,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=ITEMS)


def make_meta(config: ml_collections.ConfigDict, tokenizer_bytes: bytes, extra: dict | None = None) -> dict:
  return {
      "config": json.loads(config.to_json_best_effort()),
      "tokenizer": base64.b64encode(tokenizer_bytes).decode("ascii"),
      **(extra or {}),
  }


def meta_tokenizer_bytes(meta: dict) -> bytes:
  return base64.b64decode(meta["tokenizer"])


def meta_config(meta: dict) -> ml_collections.ConfigDict:
  return config_lib.complete(meta["config"])


class Checkpointer:
  """Saves every `every` steps (and on demand); restores the latest step."""

  def __init__(self, workdir: str, *, every: int, keep: int):
    self.every = every
    self.manager = _manager(os.path.join(workdir, "checkpoints"), keep=keep)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int) -> bool:
    return step % self.every == 0

  def save(self, step: int, weights: Any, train: Any, data_iter: grain.DatasetIterator, meta: dict) -> None:
    if step in self.manager.all_steps():
      return
    self.manager.save(step, args=ocp.args.Composite(
        weights=ocp.args.StandardSave(weights), train=ocp.args.StandardSave(train),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def restore(self, abstract_weights: Any, abstract_train: Any, data_iter: grain.DatasetIterator,
              step: int | None = None):
    """Restores weights and train state, and moves `data_iter` to the saved position."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.manager.directory}")
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(
          weights=ocp.args.StandardRestore(abstract_weights),
          train=ocp.args.StandardRestore(abstract_train), data=grain.checkpoint.CheckpointRestore(data_iter),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types; name the directory.
      raise CheckpointError(
          f"checkpoint step {step} in {self.manager.directory} is unreadable or does not match"
          f" this model: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return out.weights, out.train, out.meta

  def close(self):
    self.manager.close()


def saved_steps(root: str) -> list[int]:
  """Finalised step folders (orbax renames a step into place only when complete)."""
  if not os.path.isdir(root):
    return []
  return sorted(int(n) for n in os.listdir(root)
                if n.isdigit() and os.path.isdir(os.path.join(root, n, "weights")))


def resolve(path: str) -> tuple[str, int]:
  """Accepts a workdir, its checkpoints/ folder or one step folder; returns
  (checkpoints folder, step)."""
  path = os.path.abspath(path)
  if not os.path.exists(path):
    raise CheckpointError(f"checkpoint path {path} does not exist")
  for root in (os.path.join(path, "checkpoints"), path):
    steps = saved_steps(root)
    if steps:
      return root, steps[-1]
  parent, name = os.path.split(path)
  if name.isdigit() and os.path.isdir(os.path.join(path, "weights")):
    return parent, int(name)
  raise CheckpointError(f"no checkpoint found at {path} (expected a workdir, its checkpoints/ folder,"
                        " or a step folder)")


def read_meta(path: str) -> tuple[dict, str, int]:
  root, step = resolve(path)
  meta_file = os.path.join(root, str(step), "meta", "metadata")
  try:
    with open(meta_file) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"checkpoint {root}/{step}: metadata unreadable ({meta_file}: {e})") from e
  if not isinstance(meta, dict) or "config" not in meta or "tokenizer" not in meta:
    raise CheckpointError(f"checkpoint {root}/{step}: metadata lacks config/tokenizer ({meta_file})")
  return meta, root, step


def restore_weights(root: str, step: int, abstract_weights: Any):
  """Restores only the `weights` item ({params, ema}) for inference."""
  path = os.path.join(root, str(step), "weights")
  ckptr = ocp.StandardCheckpointer()
  try:
    out = ckptr.restore(path, abstract_weights)
  except Exception as e:
    # Not closed on failure: closing cancels orbax's pending reads, whose
    # threads then print tracebacks over our one-line error.
    raise CheckpointError(f"checkpoint {path}: weights unreadable or of another shape"
                          f" ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
  ckptr.close()
  return out


def abstract_like(tree: Any, shardings: Any = None) -> Any:
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
