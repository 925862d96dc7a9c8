"""Hugging Face folders read (LLaDA, Dream, Llama, Qwen2, Qwen3) and written (LLaDA, Dream).

Every family is the same network as ours: pre-RMSNorm blocks (weight times
x / rms(x), eps inside the root), SwiGLU, RoPE in the rotate-half layout,
optional GQA, q/k/v biases (Qwen2, Dream) and per-head q/k norms (Qwen3). So a
conversion renames tensors and transposes torch's [out, in] Linear weights; no
q/k column permutation is needed. `families` is the one place that says how,
one `Family` each; Llama, Qwen2 and Qwen3 are autoregressive (read as
objective "ar", causal), LLaDA and Dream diffusion models.

What does not map, and what happens:
  tied embeddings: LLaDA's weight_tying + scale_logits is our tied head with its
    embed_dim ** -0.5 scale; Llama/Qwen's tied head has none (scale_tied_logits
    False). Dream has neither, so a tied model is written with an explicit
    lm_head and reads back untied.
  no q/k/v biases in Dream: Qwen2 always has them; zeros are written, and dropped
    again on import when the embedded native config says the model had none.
  no [MASK] in an AR vocabulary: a special token it has no other use for
    becomes the mask (`hf_tokenizer.spare_special_id`).
  adaLN time conditioning, GELU MLPs, causal (AR) models, q/k norms: not
    exported, with an error naming the field.
config.json carries the special token ids (mask_token_id among them) and, under
"mdlm_jax", our whole training config, so a round trip keeps the diffusion
settings (schedule, block size) that the Hugging Face keys cannot hold.
The tokenizer is a sentencepiece tokenizer.model (ours) or a Hugging Face
tokenizer.json (the published checkpoints'), whose special ids are config.json's.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from jaxtyping import Float

from mdlm_jax import config as config_lib
from mdlm_jax.checkpoints import families, params_only, safetensors
from mdlm_jax.data import chat_template
from mdlm_jax.model import ModelConfig
from mdlm_jax.model.rope import RopeScaling
from mdlm_jax.data.hf_tokenizer import HFTokenizer
from mdlm_jax.data.tokenizer import Tokenizer

FORMATS = families.EXPORT_FORMATS
MODEL_TYPES = {"llada": "llada", "dream": "Dream"}  # as the published configs spell them
InteropError = families.InteropError


def _to_hf(kind: str, a: np.ndarray) -> np.ndarray:
  if kind == "same":
    return a
  if kind == "linear":
    return a.T
  if kind == "heads_in":
    return a.reshape(a.shape[0], -1).T
  if kind == "heads_out":
    return a.reshape(-1, a.shape[-1]).T
  return a.reshape(-1)  # heads_b


def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  if kind == "same":
    return shape
  if kind == "linear":
    return shape[::-1]
  if kind == "heads_in":
    return (shape[1] * shape[2], shape[0])
  if kind == "heads_out":
    return (shape[2], shape[0] * shape[1])
  return (shape[0] * shape[1],)  # heads_b


def _from_hf(kind: str, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  if kind in ("linear", "heads_in", "heads_out"):
    a = a.T
  return np.ascontiguousarray(a.reshape(shape))


def hf_name(fmt: str, native: str) -> tuple[str, str]:
  """(Hugging Face tensor name, transform) of a native parameter path in family `fmt`."""
  return families.tensor_name(families.FAMILIES[fmt], native)


def _native_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  from mdlm_jax.model.spec import model_spec
  return {k: tuple(v.shape) for k, v in params_only.flatten(model_spec(cfg, None).abstract).items()}


def _check_exportable(fmt: str, cfg: ModelConfig):
  if fmt not in FORMATS:
    raise InteropError(f"unknown format {fmt!r}; choose from {FORMATS}")
  if cfg.time_conditioning:
    raise InteropError(f"model.time_conditioning: adaLN time conditioning has no {fmt} equivalent")
  if cfg.qk_norm:
    raise InteropError(f"model.qk_norm: {fmt} has no per-head q/k norms")
  if fmt == "llada" and cfg.tie_embeddings and not cfg.scale_tied_logits:
    raise InteropError("model.scale_tied_logits=False: LLaDA's tied head always scales its logits;"
                       " export --format=dream")
  if cfg.mlp != "swiglu":
    raise InteropError(f"model.mlp={cfg.mlp!r}: {fmt} needs a SwiGLU MLP")
  if cfg.causal:
    raise InteropError(f"model.causal: {fmt} models attend bidirectionally; an AR model does not fit")
  if fmt == "llada" and cfg.rope_scaling.type != "default":
    raise InteropError(f"model.rope_scaling: LLaDA's config has no RoPE scaling; export {cfg.rope_scaling.type!r}"
                       " scaling as --format=dream")
  if fmt == "llada" and cfg.resolved_head_dim * cfg.num_heads != cfg.embed_dim:
    raise InteropError(f"model.head_dim={cfg.head_dim}: LLaDA needs head_dim = embed_dim / num_heads"
                       f" ({cfg.embed_dim} / {cfg.num_heads})")


def hf_config(fmt: str, cfg: ModelConfig, config: ml_collections.ConfigDict, tok: Tokenizer | HFTokenizer, *,
              step: int,
              dtype: str) -> dict[str, Any]:
  """config.json of the `fmt` layout; unknown keys ("mdlm_jax") are ignored by transformers."""
  seq_len = int(config.data.seq_len)
  native = {"config": json.loads(config.to_json_best_effort()), "step": int(step)}
  if fmt == "llada":
    hf = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "block_type": "llama",
          "d_model": cfg.embed_dim, "n_heads": cfg.num_heads, "n_kv_heads": cfg.resolved_kv_heads,
          "n_layers": cfg.num_layers, "mlp_hidden_size": cfg.mlp_dim, "activation_type": "silu",
          "layer_norm_type": "rms", "layer_norm_with_affine": True, "bias_for_layer_norm": False,
          "rms_norm_eps": cfg.norm_eps, "rope": True, "rope_theta": cfg.rope_theta, "rope_full_precision": True,
          "alibi": False, "attention_layer_norm": False, "input_emb_norm": False, "multi_query_attention": None,
          "include_bias": False, "include_qkv_bias": cfg.qkv_bias,
          "weight_tying": cfg.tie_embeddings, "scale_logits": cfg.tie_embeddings,
          "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size, "max_sequence_length": seq_len,
          "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0, "use_cache": False}
  else:
    hf = {"model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": cfg.embed_dim,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.resolved_kv_heads,
          "head_dim": cfg.resolved_head_dim, "num_hidden_layers": cfg.num_layers,
          "intermediate_size": cfg.mlp_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
          "rope_theta": cfg.rope_theta, "rope_scaling": hf_rope_scaling(cfg.rope_scaling),
          "tie_word_embeddings": False, "vocab_size": cfg.vocab_size,
          # Dynamic and yarn scaling measure against max_position_embeddings.
          "max_position_embeddings": cfg.rope_scaling.max_position if cfg.rope_scaling.type in ("dynamic", "yarn")
          else seq_len, "use_sliding_window": False,
          "sliding_window": None, "attention_dropout": 0.0, "use_cache": False}
  return {**hf, **tok.special_ids(), "torch_dtype": dtype, "mdlm_jax": native}


def hf_rope_scaling(s: RopeScaling) -> dict[str, Any] | None:
  """`rope_scaling` as transformers reads it back to the same frequencies
  (yarn without original_max_position_embeddings, from which transformers
  would recompute the factor)."""
  if s.type == "default":
    return None
  out: dict[str, Any] = {"rope_type": s.type, "factor": s.factor}
  if s.type == "yarn":
    out.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
    if s.attention_factor is not None:
      out["attention_factor"] = s.attention_factor
    if s.mscale and s.mscale_all_dim:
      out.update(mscale=s.mscale, mscale_all_dim=s.mscale_all_dim)
  if s.type == "llama3":
    out.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
               original_max_position_embeddings=s.max_position)
  return out


def to_hf(fmt: str, params: Any, cfg: ModelConfig) -> dict[str, Float[np.ndarray, "..."]]:
  """Named float32 Hugging Face tensors of native `params` (layer by layer, the order shards follow)."""
  _check_exportable(fmt, cfg)
  named = {k: np.asarray(jax.device_get(v), np.float32) for k, v in params_only.flatten(params).items()}
  out: dict[str, np.ndarray] = {}
  for native, a in named.items():
    name, kind = hf_name(fmt, native)
    out[name] = _to_hf(kind, a)
  if fmt == "dream":
    if cfg.tie_embeddings:  # Qwen2 has no logit scale: fold ours into an explicit head
      scale = cfg.embed_dim ** -0.5 if cfg.scale_tied_logits else 1.0
      out["lm_head.weight"] = named["embedding"] * np.float32(scale)
    if not cfg.qkv_bias:  # Qwen2 always has q/k/v biases
      g, k = cfg.resolved_kv_heads, cfg.resolved_head_dim
      for i in range(cfg.num_layers):
        for b, heads in (("bq", cfg.num_heads), ("bk", g), ("bv", g)):
          out[hf_name(fmt, f"blocks.{i}.attn.{b}")[0]] = np.zeros((heads * k,), np.float32)
  return dict(sorted(out.items(), key=lambda kv: _layer_order(kv[0])))


def _layer_order(name: str) -> tuple[int, str]:
  for part in name.split("."):
    if part.isdigit():
      return int(part), name
  return -1, name


def tokenizer_config(tok: Tokenizer | HFTokenizer) -> dict[str, Any]:
  """tokenizer_config.json: which pieces and ids are special (the model itself is tok.file())."""
  ids = {**tok.special_ids(), **({"unk_token_id": tok.unk_id} if tok.unk_id >= 0 else {})}
  pieces = {name[:-3]: tok.piece(i) for name, i in ids.items()}
  if isinstance(tok, HFTokenizer):  # what transformers' AutoTokenizer needs to load tokenizer.json
    kind = {"tokenizer_class": "PreTrainedTokenizerFast", "tokenizer_kind": "huggingface"}
  else:
    kind = {"tokenizer_file": "tokenizer.model", "tokenizer_kind": "sentencepiece"}
  return {**kind, **{k: v for k, v in pieces.items() if v}, **ids, "add_bos_token": False, "add_eos_token": False}


def save(out: str, fmt: str, params: Any, config: ml_collections.ConfigDict, tok: Tokenizer | HFTokenizer, *,
         step: int,
         dtype: str = "bfloat16", max_shard_bytes: int = params_only.DEFAULT_MAX_SHARD,
         overwrite: bool = False, chat_template: str | None = None) -> str:
  """Writes `out` in the `fmt` layout, atomically: safetensors (sharded past
  `max_shard_bytes`), config.json, tokenizer.model or tokenizer.json, and
  tokenizer_config.json (with the chat template, where transformers reads it)."""
  if dtype not in params_only.DTYPES:
    raise ValueError(f"dtype must be one of {params_only.DTYPES}, got {dtype!r}")
  cfg = ModelConfig.from_config(config.model, vocab_size=tok.vocab_size)
  np_dtype = np.dtype(jax.numpy.dtype(dtype))
  tensors = {k: v.astype(np_dtype) for k, v in to_hf(fmt, params, cfg).items()}
  with params_only.atomic_folder(out, overwrite) as tmp:
    safetensors.save_folder(tmp, tensors, max_shard_bytes=max_shard_bytes, metadata={"format": "pt"})
    name, data = tok.file()
    with open(os.path.join(tmp, name), "wb") as f:
      f.write(data)
    for name, obj in (("config.json", hf_config(fmt, cfg, config, tok, step=step, dtype=dtype)),
                      ("tokenizer_config.json", {**tokenizer_config(tok),
                                                 **({"chat_template": chat_template} if chat_template else {})})):
      with open(os.path.join(tmp, name), "w") as f:
        json.dump(obj, f, indent=1)
  return os.path.abspath(out)


# ---- import ----

def hf_format(path: str) -> str | None:
  """The family (families.FAMILIES) whose model_type `path`'s config.json names, else None."""
  try:
    with open(os.path.join(path, "config.json")) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  family = families.by_model_type(meta.get("model_type", "")) if isinstance(meta, dict) else None
  return family.name if family else None


def _model_fields(fmt: str, hf: dict, tensors: dict, source: str) -> tuple[dict, bool]:
  """Our config.model fields from a config.json, and whether the head is the embedding."""
  family = families.FAMILIES[fmt]
  fields, head_is_embedding = family.fields(hf, tensors, source)
  if fields["num_kv_heads"] == fields["num_heads"]:
    fields["num_kv_heads"] = -1
  fields = dict(fields, mlp="swiglu", causal=family.causal, time_conditioning=False, vocab_size=-1)
  if family.causal:
    fields["shift_logits"] = False
  return fields, head_is_embedding


def _tokenizer(fmt: str, path: str, tokenizer_path: str | None, hf: dict) -> Tokenizer | HFTokenizer:
  """--tokenizer (a .model, or a .json read like the folder's), else the folder's tokenizer.model,
  else its tokenizer.json with the special ids of config.json / tokenizer_config.json. An AR
  family's vocabulary without a mask token lends one of its spare special tokens."""
  if not tokenizer_path:
    tokenizer_path = next((os.path.join(path, n) for n in ("tokenizer.model", "tokenizer.json")
                           if os.path.isfile(os.path.join(path, n))), None)
    if tokenizer_path is None:
      raise InteropError(f"{path} has no tokenizer.model or tokenizer.json; pass --tokenizer=PATH")
  if tokenizer_path.endswith(".json"):
    rows = hf.get("embedding_size") if fmt == "llada" else None
    spare = (chat_template.from_folder(path) or "") if families.FAMILIES[fmt].causal else None
    try:
      return HFTokenizer.from_hf_folder(path, hf, tokenizer_path, vocab_size=rows or hf.get("vocab_size"),
                                        spare_mask=spare)
    except ValueError as e:
      raise InteropError(str(e)) from None
  tok = Tokenizer.from_file(tokenizer_path)
  want = hf.get("mask_token_id")
  if want is not None and want != tok.mask_id:
    raise InteropError(f"{path}: config.json has mask_token_id={want} but the tokenizer's [MASK] is {tok.mask_id}")
  return tok


# Tensors a folder may carry that are not weights (old Llama exports kept RoPE's frequencies).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read(path: str, tokenizer_path: str | None = None
         ) -> tuple[ml_collections.ConfigDict, Tokenizer | HFTokenizer, dict[str, Float[np.ndarray, "..."]], int]:
  """(our config, tokenizer, named float32 native params, step) of a Hugging Face folder of
  any family in `families.FAMILIES` (LLaDA, Dream, Llama, Qwen2, Qwen3).

  Every tensor is checked: a missing, unexpected or mis-shaped one is an
  InteropError naming it."""
  if not os.path.isdir(path):
    raise InteropError(f"{path}: no such folder")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise InteropError(f"{path}: no config.json (a Hugging Face model folder has one)")
  fmt = hf_format(path)
  if fmt is None:
    raise InteropError(f"{path}: config.json does not name a supported model_type"
                       f" ({', '.join(f.model_type for f in families.FAMILIES.values())})")
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  try:
    tensors, _ = safetensors.load_folder(path)
  except safetensors.SafetensorsError as e:
    raise InteropError(str(e)) from None
  tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
  _model_fields(fmt, hf, tensors, path)  # config errors before tokenizer errors
  return convert(fmt, hf, tensors, _tokenizer(fmt, path, tokenizer_path, hf), path)


def convert(fmt: str, hf: dict, tensors: dict[str, np.ndarray], tok: Tokenizer | HFTokenizer, source: str
            ) -> tuple[ml_collections.ConfigDict, Tokenizer | HFTokenizer, dict[str, Float[np.ndarray, "..."]], int]:
  """(our config, tok, named float32 native params, step) of family `fmt`'s config.json
  keys `hf` and its tensors (by the family's names); `source` names them in errors."""
  family = families.FAMILIES[fmt]
  fields, head_is_embedding = _model_fields(fmt, hf, tensors, source)
  native = hf.get("mdlm_jax") if isinstance(hf.get("mdlm_jax"), dict) else {}
  config = config_lib.complete(native["config"] if isinstance(native.get("config"), dict) else {})
  if not isinstance(native.get("config"), dict):
    config.data.seq_len = int(hf.get("max_sequence_length") or hf.get("max_position_embeddings") or 4096)
  if family.causal:
    config.objective = "ar"
  drop_bias = fmt == "dream" and fields["qkv_bias"] and config.model.qkv_bias is False
  config.model.update(fields)
  try:
    config_lib.validate(config)
  except config_lib.ConfigError as e:
    raise InteropError(f"{source}: {e}") from None
  cfg = ModelConfig.from_config(config.model, vocab_size=tok.vocab_size)
  shapes = _native_shapes(cfg)
  head_name = family.names["head"]
  if head_is_embedding and "head" in shapes and head_name not in tensors:
    tensors[head_name] = tensors.get(family.names["embedding"])
  if cfg.tie_embeddings and not cfg.scale_tied_logits:
    tensors.pop(head_name, None)  # a tied family's lm_head is the embedding (transformers ties it on load)
  named, used = {}, set()
  for native_name, shape in shapes.items():
    name, kind = hf_name(fmt, native_name)
    if name not in tensors or tensors[name] is None:
      raise InteropError(f"{source}: tensor {name} is missing (it holds {native_name})")
    a = tensors[name]
    if tuple(a.shape) != _hf_shape(kind, shape):
      raise InteropError(f"{source}: tensor {name} has shape {tuple(a.shape)}, the config gives"
                         f" {_hf_shape(kind, shape)} (tokenizer vocab {tok.vocab_size})")
    named[native_name] = _from_hf(kind, np.asarray(a, np.float32), shape)
    used.add(name)
  extra = sorted(set(tensors) - used)
  if extra:
    raise InteropError(f"{source}: unexpected tensors {extra[:3]}{'...' if len(extra) > 3 else ''}")
  if drop_bias:
    biases = [k for k in named if k.split(".")[-1] in ("bq", "bk", "bv")]
    if all(not named[k].any() for k in biases):  # the zeros export wrote for a bias-free model
      named = {k: v for k, v in named.items() if k not in biases}
      config.model.qkv_bias = False
  return config, tok, named, int(native.get("step", 0))
