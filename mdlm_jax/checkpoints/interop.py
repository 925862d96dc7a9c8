"""Checkpoints in the Hugging Face layouts of LLaDA and Dream, written and read.

LLaDA (GSAI-ML/LLaDA-8B-*, model_type "llada") and Dream (Dream-org/Dream-v0-*,
model_type "Dream", Qwen2 tensor names) are the same network as ours: pre-RMSNorm
blocks (weight times x / rms(x), eps inside the root), SwiGLU, RoPE in the
rotate-half layout, bidirectional attention with optional GQA and q/k/v biases.
So a conversion renames tensors and transposes torch's [out, in] Linear weights;
no q/k column permutation is needed. `TABLE` is the one place that says how.

What does not map, and what happens:
  tied embeddings: our tied head scales logits by embed_dim ** -0.5, which is
    LLaDA's weight_tying + scale_logits; Dream has no such scale, so a tied model
    is written with an explicit lm_head (embedding.T / sqrt(d)) and reads back untied.
  no q/k/v biases in Dream: Qwen2 always has them; zeros are written, and dropped
    again on import when the embedded native config says the model had none.
  adaLN time conditioning, GELU MLPs, causal (AR) models: refused with an error.
config.json carries the special token ids (mask_token_id among them) and, under
"mdlm_jax", our whole training config, so a round trip keeps the diffusion
settings (schedule, block size) that the Hugging Face keys cannot hold.
The tokenizer is a sentencepiece tokenizer.model (ours) or a Hugging Face
tokenizer.json (the published checkpoints'), whose special ids are config.json's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
from jaxtyping import Float

from mdlm_jax import config as config_lib
from mdlm_jax.checkpoints import params_only, safetensors
from mdlm_jax.model import ModelConfig
from mdlm_jax.model.rope import RopeScaling
from mdlm_jax.data.hf_tokenizer import HFTokenizer
from mdlm_jax.data.tokenizer import Tokenizer

FORMATS = ("llada", "dream")
MODEL_TYPES = {"llada": "llada", "dream": "Dream"}

# native parameter path -> (LLaDA name, Dream name, transform). {i} is the block index.
# Transforms between our kernels ([in, ..., out]) and torch Linear weights ([out, in]):
#   same      identical array (norm scales, the embedding)
#   linear    [in, out] <-> [out, in]
#   heads_in  [d, heads, head_dim] <-> [heads * head_dim, d]    (q/k/v projections)
#   heads_out [heads, head_dim, d] <-> [d, heads * head_dim]    (attention output)
#   heads_b   [heads, head_dim] <-> [heads * head_dim]          (q/k/v biases)
TABLE: dict[str, tuple[str, str, str]] = {
    "embedding": ("model.transformer.wte.weight", "model.embed_tokens.weight", "same"),
    "final_norm.scale": ("model.transformer.ln_f.weight", "model.norm.weight", "same"),
    "head": ("model.transformer.ff_out.weight", "lm_head.weight", "linear"),
    "blocks.{i}.attn_norm.scale": ("model.transformer.blocks.{i}.attn_norm.weight",
                                   "model.layers.{i}.input_layernorm.weight", "same"),
    "blocks.{i}.attn.wq": ("model.transformer.blocks.{i}.q_proj.weight",
                           "model.layers.{i}.self_attn.q_proj.weight", "heads_in"),
    "blocks.{i}.attn.wk": ("model.transformer.blocks.{i}.k_proj.weight",
                           "model.layers.{i}.self_attn.k_proj.weight", "heads_in"),
    "blocks.{i}.attn.wv": ("model.transformer.blocks.{i}.v_proj.weight",
                           "model.layers.{i}.self_attn.v_proj.weight", "heads_in"),
    "blocks.{i}.attn.bq": ("model.transformer.blocks.{i}.q_proj.bias",
                           "model.layers.{i}.self_attn.q_proj.bias", "heads_b"),
    "blocks.{i}.attn.bk": ("model.transformer.blocks.{i}.k_proj.bias",
                           "model.layers.{i}.self_attn.k_proj.bias", "heads_b"),
    "blocks.{i}.attn.bv": ("model.transformer.blocks.{i}.v_proj.bias",
                           "model.layers.{i}.self_attn.v_proj.bias", "heads_b"),
    "blocks.{i}.attn.wo": ("model.transformer.blocks.{i}.attn_out.weight",
                           "model.layers.{i}.self_attn.o_proj.weight", "heads_out"),
    "blocks.{i}.mlp_norm.scale": ("model.transformer.blocks.{i}.ff_norm.weight",
                                  "model.layers.{i}.post_attention_layernorm.weight", "same"),
    "blocks.{i}.mlp.w_gate": ("model.transformer.blocks.{i}.ff_proj.weight",
                              "model.layers.{i}.mlp.gate_proj.weight", "linear"),
    "blocks.{i}.mlp.w_up": ("model.transformer.blocks.{i}.up_proj.weight",
                            "model.layers.{i}.mlp.up_proj.weight", "linear"),
    "blocks.{i}.mlp.w_down": ("model.transformer.blocks.{i}.ff_out.weight",
                              "model.layers.{i}.mlp.down_proj.weight", "linear"),
}


class InteropError(ValueError):
  """A model or folder that cannot be converted; the message names what is wrong."""


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
  """(Hugging Face tensor name, transform) of a native parameter path in layout `fmt`."""
  parts = native.split(".")
  key, i = native, None
  if parts[0] == "blocks" and len(parts) > 1:
    key, i = ".".join(["blocks", "{i}", *parts[2:]]), parts[1]
  if key not in TABLE:
    raise InteropError(f"parameter {native} has no {fmt} name")
  llada, dream, kind = TABLE[key]
  return (llada if fmt == "llada" else dream).replace("{i}", str(i)), kind


def _native_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  from mdlm_jax.model.spec import model_spec
  return {k: tuple(v.shape) for k, v in params_only.flatten(model_spec(cfg, None).abstract).items()}


def _check_exportable(fmt: str, cfg: ModelConfig):
  if fmt not in FORMATS:
    raise InteropError(f"unknown format {fmt!r}; choose from {FORMATS}")
  if cfg.time_conditioning:
    raise InteropError(f"model.time_conditioning: adaLN time conditioning has no {fmt} equivalent")
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
          "rope_theta": cfg.rope_theta, "rope_scaling": _hf_rope_scaling(cfg.rope_scaling),
          "tie_word_embeddings": False, "vocab_size": cfg.vocab_size,
          # Dynamic and yarn scaling measure against max_position_embeddings.
          "max_position_embeddings": cfg.rope_scaling.max_position if cfg.rope_scaling.type in ("dynamic", "yarn")
          else seq_len, "use_sliding_window": False,
          "sliding_window": None, "attention_dropout": 0.0, "use_cache": False}
  return {**hf, **tok.special_ids(), "torch_dtype": dtype, "mdlm_jax": native}


def _hf_rope_scaling(s: RopeScaling) -> dict[str, Any] | None:
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
      out["lm_head.weight"] = named["embedding"] * np.float32(cfg.embed_dim ** -0.5)
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
  """"llada" or "dream" when `path` holds a config.json of that model_type, else None."""
  try:
    with open(os.path.join(path, "config.json")) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  mt = str(meta.get("model_type", "")).lower() if isinstance(meta, dict) else ""
  return {"llada": "llada", "dream": "dream"}.get(mt)


def _need(hf: dict, key: str, want, source: str):
  if key in hf and hf[key] != want:
    raise InteropError(f"{source}: {key}={hf[key]!r} is not supported (mdlm_jax reads {key}={want!r})")


def _get(hf: dict, key: str, source: str):
  if key not in hf:
    raise InteropError(f"{source}: config.json lacks {key}")
  return hf[key]


def _model_fields(fmt: str, hf: dict, tensors: dict, source: str) -> tuple[dict, bool]:
  """Our config.model fields from a config.json, and whether the head is the embedding."""
  if fmt == "llada":
    for key, want in (("block_type", "llama"), ("activation_type", "silu"), ("layer_norm_type", "rms"),
                      ("layer_norm_with_affine", True), ("rope", True), ("alibi", False), ("include_bias", False),
                      ("attention_layer_norm", False), ("input_emb_norm", False)):
      _need(hf, key, want, source)
    if hf.get("multi_query_attention"):
      raise InteropError(f"{source}: multi_query_attention=true is not supported (give n_kv_heads=1 instead)")
    if hf.get("scale_logits", False) and not hf.get("weight_tying", False):
      raise InteropError(f"{source}: scale_logits without weight_tying is not supported")
    heads = _get(hf, "n_heads", source)
    fields = dict(num_layers=_get(hf, "n_layers", source), embed_dim=_get(hf, "d_model", source), num_heads=heads,
                  num_kv_heads=hf.get("n_kv_heads") or heads, mlp_dim=_get(hf, "mlp_hidden_size", source),
                  rope_theta=float(hf.get("rope_theta", 10000.0)), norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                  qkv_bias=bool(hf.get("include_qkv_bias", False)), head_dim=-1,
                  tie_embeddings=bool(hf.get("weight_tying", False) and hf.get("scale_logits", False)))
    head_is_embedding = bool(hf.get("weight_tying", False)) and not fields["tie_embeddings"]
  else:
    _need(hf, "hidden_act", "silu", source)
    if hf.get("use_sliding_window"):
      raise InteropError(f"{source}: use_sliding_window=true is not supported")
    rope = hf.get("rope_parameters") or {}
    try:
      scaling = RopeScaling.from_hf(hf)
    except ValueError as e:
      raise InteropError(f"{source}: {e}") from None
    heads = _get(hf, "num_attention_heads", source)
    d = _get(hf, "hidden_size", source)
    fields = dict(num_layers=_get(hf, "num_hidden_layers", source), embed_dim=d, num_heads=heads,
                  num_kv_heads=hf.get("num_key_value_heads") or heads,
                  head_dim=-1 if hf.get("head_dim") in (None, d // heads) else hf["head_dim"],
                  mlp_dim=_get(hf, "intermediate_size", source),
                  rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                  norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=False,
                  qkv_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
                  rope_scaling=dataclasses.asdict(scaling))
    head_is_embedding = bool(hf.get("tie_word_embeddings", False))
  if fields["num_kv_heads"] == fields["num_heads"]:
    fields["num_kv_heads"] = -1
  return dict(fields, mlp="swiglu", causal=False, time_conditioning=False, vocab_size=-1), head_is_embedding


def _tokenizer(fmt: str, path: str, tokenizer_path: str | None, hf: dict) -> Tokenizer | HFTokenizer:
  """--tokenizer (a .model, or a .json read like the folder's), else the folder's tokenizer.model,
  else its tokenizer.json with the special ids of config.json / tokenizer_config.json."""
  if not tokenizer_path:
    tokenizer_path = next((os.path.join(path, n) for n in ("tokenizer.model", "tokenizer.json")
                           if os.path.isfile(os.path.join(path, n))), None)
    if tokenizer_path is None:
      raise InteropError(f"{path} has no tokenizer.model or tokenizer.json; pass --tokenizer=PATH")
  if tokenizer_path.endswith(".json"):
    rows = hf.get("embedding_size") if fmt == "llada" else None
    try:
      return HFTokenizer.from_hf_folder(path, hf, tokenizer_path, vocab_size=rows or hf.get("vocab_size"))
    except ValueError as e:
      raise InteropError(str(e)) from None
  tok = Tokenizer.from_file(tokenizer_path)
  want = hf.get("mask_token_id")
  if want is not None and want != tok.mask_id:
    raise InteropError(f"{path}: config.json has mask_token_id={want} but the tokenizer's [MASK] is {tok.mask_id}")
  return tok


def read(path: str, tokenizer_path: str | None = None
         ) -> tuple[ml_collections.ConfigDict, Tokenizer | HFTokenizer, dict[str, Float[np.ndarray, "..."]], int]:
  """(our config, tokenizer, named float32 native params, step) of a LLaDA/Dream folder.

  Every tensor is checked: a missing, unexpected or mis-shaped one is an
  InteropError naming it."""
  fmt = hf_format(path)
  if fmt is None:
    raise InteropError(f"{path}: config.json does not name a llada or Dream model_type")
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  try:
    tensors, _ = safetensors.load_folder(path)
  except safetensors.SafetensorsError as e:
    raise InteropError(str(e)) from None
  fields, head_is_embedding = _model_fields(fmt, hf, tensors, path)
  native = hf.get("mdlm_jax") if isinstance(hf.get("mdlm_jax"), dict) else {}
  config = config_lib.base_config()
  if isinstance(native.get("config"), dict):
    config.update(ml_collections.ConfigDict(native["config"]))
  else:
    config.data.seq_len = int(hf.get("max_sequence_length") or hf.get("max_position_embeddings") or 4096)
  drop_bias = fmt == "dream" and fields["qkv_bias"] and config.model.get("qkv_bias", True) is False
  config.model.update(fields)
  config_lib.validate(config)
  tok = _tokenizer(fmt, path, tokenizer_path, hf)
  cfg = ModelConfig.from_config(config.model, vocab_size=tok.vocab_size)
  shapes = _native_shapes(cfg)
  if head_is_embedding and "head" in shapes:
    hf_head = hf_name(fmt, "head")[0]
    if hf_head not in tensors:
      tensors[hf_head] = tensors.get(hf_name(fmt, "embedding")[0])
  named, used = {}, set()
  for native_name, shape in shapes.items():
    name, kind = hf_name(fmt, native_name)
    if name not in tensors or tensors[name] is None:
      raise InteropError(f"{path}: tensor {name} is missing (it holds {native_name})")
    a = tensors[name]
    if tuple(a.shape) != _hf_shape(kind, shape):
      raise InteropError(f"{path}: tensor {name} has shape {tuple(a.shape)}, config.json gives"
                         f" {_hf_shape(kind, shape)} (tokenizer vocab {tok.vocab_size})")
    named[native_name] = _from_hf(kind, a.astype(np.float32), shape)
    used.add(name)
  extra = sorted(set(tensors) - used)
  if extra:
    raise InteropError(f"{path}: unexpected tensors {extra[:3]}{'...' if len(extra) > 3 else ''}")
  if drop_bias:
    biases = [k for k in named if k.split(".")[-1] in ("bq", "bk", "bv")]
    if all(not named[k].any() for k in biases):  # the zeros export wrote for a bias-free model
      named = {k: v for k, v in named.items() if k not in biases}
      config.model.qkv_bias = False
  return config, tok, named, int(native.get("step", 0))
