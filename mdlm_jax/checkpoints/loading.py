"""Loading any checkpoint this package reads into params on a mesh.

Training checkpoints (EMA weights when present), params-only folders, GGUF
files and Hugging Face folders all come back as one `LoadedModel`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from mdlm_jax import config as config_lib
from mdlm_jax.checkpoints import checkpointer, params_only
from mdlm_jax.data.hf_tokenizer import HFTokenizer
from mdlm_jax.data.tokenizer import Tokenizer, load_bytes as load_tokenizer_bytes
from mdlm_jax.model.spec import ModelSpec, bind, model_spec
from mdlm_jax.model.transformer import ModelConfig, Transformer
from mdlm_jax.parallel import sharding


@dataclasses.dataclass
class LoadedModel:
  spec: ModelSpec
  params: Any
  tokenizer: Tokenizer | HFTokenizer
  config: ml_collections.ConfigDict
  step: int
  has_ema: bool
  # The Jinja chat template (data.chat_template), when the checkpoint has one.
  chat_template: str | None = None
  # Drafts for revising passes from the model's own answers (`sampling.draft_table`), when its folder has one.
  draft_table: Any = None

  @property
  def model(self) -> Transformer:
    return bind(self.spec, self.params)


def load(path: str, mesh: Mesh | None = None, use_ema: bool = True) -> LoadedModel:
  """Loads a training checkpoint (EMA weights when present), a params-only
  folder (`params_only`), a GGUF file (`gguf_file`) or a Hugging Face folder of
  a family `interop` reads (LLaDA, Dream, Llama, Qwen2, Qwen3) for inference.

  The checkpoint may come from any mesh; it is resharded onto `mesh` (by
  default one device)."""
  from mdlm_jax.checkpoints import registry
  path = registry.resolve(path)
  if mesh is None:
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  from mdlm_jax.data import chat_template
  if params_only.is_params_dir(path):
    loaded = _load_params_only(path, mesh)
    return dataclasses.replace(loaded, chat_template=chat_template.from_folder(path) or _base_template(loaded.config),
                               draft_table=_draft_table(path, loaded.spec.cfg.vocab_size))
  from mdlm_jax.checkpoints import gguf_file, interop
  if gguf_file.is_gguf(path):
    config, tokenizer, named, step, template = gguf_file.read(path)
    return dataclasses.replace(_place(path, config, tokenizer, named, step, mesh), chat_template=template)
  if interop.hf_format(path) is not None:
    config, tokenizer, named, step = interop.read(path)
    return dataclasses.replace(_place(path, config, tokenizer, named, step, mesh),
                               chat_template=chat_template.from_folder(path))
  meta, root, step = checkpointer.read_meta(path)
  config = checkpointer.meta_config(meta)
  tokenizer = load_tokenizer_bytes(checkpointer.meta_tokenizer_bytes(meta))
  cfg = ModelConfig.from_config(config.model, vocab_size=tokenizer.vocab_size)
  spec = model_spec(cfg, mesh)
  abstract = checkpointer.abstract_like(spec.abstract, spec.shardings)
  want_ema = use_ema and meta.get("has_ema", False)
  target = {"params": abstract, "ema": abstract} if meta.get("has_ema", False) else {"params": abstract}
  state = checkpointer.restore_weights(root, step, target)
  params = state["ema"] if want_ema else state["params"]
  return LoadedModel(spec, params, tokenizer, config, step, bool(meta.get("has_ema", False)),
                     chat_template.named(config.data.chat_template) or _base_template(config))


def _load_params_only(path: str, mesh: Mesh) -> LoadedModel:
  meta, tokenizer, named = params_only.read(path)
  config = config_lib.complete(meta["config"])
  if meta.get("base"):  # an adaptation: its adapters over a base's weights
    named = {**_base_weights(meta["base"], path), **named}
  return _place(path, config, tokenizer, named, int(meta.get("step", 0)), mesh)


def _draft_table(path: str, vocab_size: int):
  from mdlm_jax.sampling import draft_table
  table = os.path.join(path, draft_table.FILE_NAME)
  return draft_table.load(table, vocab_size) if os.path.isfile(table) else None


def _base_template(config: ml_collections.ConfigDict) -> str | None:
  """The chat template of the model a run started from (train.init_from), when
  it has one: an AR model adapted to diffusion keeps its base's chat format."""
  from mdlm_jax.checkpoints import gguf_file, registry
  from mdlm_jax.data import chat_template
  base = config.train.init_from
  if not base or config.data.chat_template:
    return None
  if base in registry.MODELS:
    if not registry.is_cached(base):
      return None
    base = registry.cached_path(base)
  if gguf_file.is_gguf(base) and os.path.isfile(base):
    return gguf_file.chat_template_of(base)
  return chat_template.from_folder(base) if os.path.isdir(base) else None


def frozen_base(config: ml_collections.ConfigDict) -> str:
  """The model whose weights an adapters-only run kept frozen: its
  train.init_from, followed back through earlier adapter stages (a training
  run or an adapters-only folder that itself trained adapters over a base) to
  the first model that is not one (a registry name, a GGUF file, a full
  checkpoint). "" when the run started from nothing. Raises FileNotFoundError
  when a folder along the way is gone, rather than naming it as the base."""
  import json
  from mdlm_jax.checkpoints import gguf_file, registry
  base, seen = config.train.init_from, {}  # ordered, for the error message
  while base and base not in registry.MODELS and not gguf_file.is_gguf(base):
    if not os.path.exists(base):
      chain = " -> ".join([*seen, base]) if seen else base
      raise FileNotFoundError(f"train.init_from names {base!r}, which does not exist (followed {chain}); restore"
                              " that folder or point init_from at a checkpoint that exists")
    if base in seen:
      raise ValueError(f"train.init_from loops back to {base}")
    seen[base] = None
    if params_only.is_params_dir(base):
      with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
        meta = json.load(f)
      if not meta.get("base"):
        return base
      base = meta["base"]
      continue
    try:
      meta, _, _ = checkpointer.read_meta(base)
    except checkpointer.CheckpointError:
      return base  # a Hugging Face folder, or anything else load reads whole
    earlier = config_lib.complete(meta["config"]).train
    if earlier.trainable != "adapters" or not earlier.init_from:
      return base
    base = earlier.init_from
  return base


def _base_weights(base: str, path: str) -> dict:
  """The named float32 weights of the base an adapters-only folder names (any
  checkpoint `load` reads: a registry name, GGUF file, folder or training run)."""
  try:
    loaded = load(base)
  except (FileNotFoundError, ValueError) as e:
    raise params_only.ParamsFileError(f"{path}: cannot read its base {base!r}: {e}") from None
  return {k: np.asarray(jax.device_get(v), np.float32) for k, v in params_only.flatten(loaded.params).items()}


def _place(path: str, config: ml_collections.ConfigDict, tokenizer: Tokenizer | HFTokenizer, named, step: int,
           mesh: Mesh) -> LoadedModel:
  """Named host arrays -> params sharded onto `mesh`, checked against the config's shapes."""
  cfg = ModelConfig.from_config(config.model, vocab_size=tokenizer.vocab_size)
  spec = model_spec(cfg, mesh)
  host = params_only.unflatten_like(spec.abstract, named, path)
  # Every process holds the whole file; each places the slices of its own devices.
  params = jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), host, spec.shardings)
  return LoadedModel(spec, params, tokenizer, config, step, False)
