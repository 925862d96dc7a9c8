"""The Hugging Face model families this package reads, one `Family` each.

Every family here is our network under other names: pre-RMSNorm blocks, SwiGLU,
RoPE in the rotate-half layout, grouped-query attention. A family says what its
tensors are called (`names`: our parameter path -> its tensor name) and how its
config.json becomes our config.model (`fields`); the transform of each tensor
depends only on our parameter (`KINDS`). Adding a family is one `Family` in
`FAMILIES`. GGUF files (checkpoints/gguf.py) name one of these families by
`general.architecture` and are read through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from mdlm_jax.model.rope import RopeScaling


class InteropError(ValueError):
  """A model or folder that cannot be converted; the message names what is wrong."""


# How each of our parameters maps to a torch tensor. Our kernels are [in, ..., out]; torch Linear weights [out, in]:
#   same      identical array (norm scales, the embedding)
#   linear    [in, out] <-> [out, in]
#   heads_in  [d, heads, head_dim] <-> [heads * head_dim, d]    (q/k/v projections)
#   heads_out [heads, head_dim, d] <-> [d, heads * head_dim]    (attention output)
#   heads_b   [heads, head_dim] <-> [heads * head_dim]          (q/k/v biases)
KINDS: dict[str, str] = {
    "embedding": "same", "final_norm.scale": "same", "head": "linear",
    "blocks.{i}.attn_norm.scale": "same", "blocks.{i}.mlp_norm.scale": "same",
    "blocks.{i}.attn.wq": "heads_in", "blocks.{i}.attn.wk": "heads_in", "blocks.{i}.attn.wv": "heads_in",
    "blocks.{i}.attn.bq": "heads_b", "blocks.{i}.attn.bk": "heads_b", "blocks.{i}.attn.bv": "heads_b",
    "blocks.{i}.attn.wo": "heads_out",
    "blocks.{i}.attn.q_norm.scale": "same", "blocks.{i}.attn.k_norm.scale": "same",
    "blocks.{i}.mlp.w_gate": "linear", "blocks.{i}.mlp.w_up": "linear", "blocks.{i}.mlp.w_down": "linear",
}

# transformers' Llama names, shared by Qwen2, Qwen3, SmolLM and Dream.
LLAMA_NAMES: dict[str, str] = {
    "embedding": "model.embed_tokens.weight",
    "final_norm.scale": "model.norm.weight",
    "head": "lm_head.weight",
    "blocks.{i}.attn_norm.scale": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.wq": "model.layers.{i}.self_attn.q_proj.weight",
    "blocks.{i}.attn.wk": "model.layers.{i}.self_attn.k_proj.weight",
    "blocks.{i}.attn.wv": "model.layers.{i}.self_attn.v_proj.weight",
    "blocks.{i}.attn.bq": "model.layers.{i}.self_attn.q_proj.bias",
    "blocks.{i}.attn.bk": "model.layers.{i}.self_attn.k_proj.bias",
    "blocks.{i}.attn.bv": "model.layers.{i}.self_attn.v_proj.bias",
    "blocks.{i}.attn.wo": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.attn.q_norm.scale": "model.layers.{i}.self_attn.q_norm.weight",
    "blocks.{i}.attn.k_norm.scale": "model.layers.{i}.self_attn.k_norm.weight",
    "blocks.{i}.mlp_norm.scale": "model.layers.{i}.post_attention_layernorm.weight",
    "blocks.{i}.mlp.w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "blocks.{i}.mlp.w_up": "model.layers.{i}.mlp.up_proj.weight",
    "blocks.{i}.mlp.w_down": "model.layers.{i}.mlp.down_proj.weight",
}

LLADA_NAMES: dict[str, str] = {
    "embedding": "model.transformer.wte.weight",
    "final_norm.scale": "model.transformer.ln_f.weight",
    "head": "model.transformer.ff_out.weight",
    "blocks.{i}.attn_norm.scale": "model.transformer.blocks.{i}.attn_norm.weight",
    "blocks.{i}.attn.wq": "model.transformer.blocks.{i}.q_proj.weight",
    "blocks.{i}.attn.wk": "model.transformer.blocks.{i}.k_proj.weight",
    "blocks.{i}.attn.wv": "model.transformer.blocks.{i}.v_proj.weight",
    "blocks.{i}.attn.bq": "model.transformer.blocks.{i}.q_proj.bias",
    "blocks.{i}.attn.bk": "model.transformer.blocks.{i}.k_proj.bias",
    "blocks.{i}.attn.bv": "model.transformer.blocks.{i}.v_proj.bias",
    "blocks.{i}.attn.wo": "model.transformer.blocks.{i}.attn_out.weight",
    "blocks.{i}.mlp_norm.scale": "model.transformer.blocks.{i}.ff_norm.weight",
    "blocks.{i}.mlp.w_gate": "model.transformer.blocks.{i}.ff_proj.weight",
    "blocks.{i}.mlp.w_up": "model.transformer.blocks.{i}.up_proj.weight",
    "blocks.{i}.mlp.w_down": "model.transformer.blocks.{i}.ff_out.weight",
}


# llama.cpp's tensor names (GGUF), the same for every family it reads as Llama-like.
GGUF_NAMES: dict[str, str] = {
    "embedding": "token_embd.weight",
    "final_norm.scale": "output_norm.weight",
    "head": "output.weight",
    "blocks.{i}.attn_norm.scale": "blk.{i}.attn_norm.weight",
    "blocks.{i}.attn.wq": "blk.{i}.attn_q.weight",
    "blocks.{i}.attn.wk": "blk.{i}.attn_k.weight",
    "blocks.{i}.attn.wv": "blk.{i}.attn_v.weight",
    "blocks.{i}.attn.bq": "blk.{i}.attn_q.bias",
    "blocks.{i}.attn.bk": "blk.{i}.attn_k.bias",
    "blocks.{i}.attn.bv": "blk.{i}.attn_v.bias",
    "blocks.{i}.attn.wo": "blk.{i}.attn_output.weight",
    "blocks.{i}.attn.q_norm.scale": "blk.{i}.attn_q_norm.weight",
    "blocks.{i}.attn.k_norm.scale": "blk.{i}.attn_k_norm.weight",
    "blocks.{i}.mlp_norm.scale": "blk.{i}.ffn_norm.weight",
    "blocks.{i}.mlp.w_gate": "blk.{i}.ffn_gate.weight",
    "blocks.{i}.mlp.w_up": "blk.{i}.ffn_up.weight",
    "blocks.{i}.mlp.w_down": "blk.{i}.ffn_down.weight",
}


def _need(hf: dict, key: str, want, source: str):
  if key in hf and hf[key] != want:
    raise InteropError(f"{source}: {key}={hf[key]!r} is not supported (mdlm_jax reads {key}={want!r})")


def _get(hf: dict, key: str, source: str):
  if key not in hf:
    raise InteropError(f"{source}: config.json lacks {key}")
  return hf[key]


def _llada_fields(hf: dict, tensors: Mapping[str, Any], source: str) -> tuple[dict, bool]:
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
  # Tied without the scale: read back as an explicit head (the native config, when present, says more).
  return fields, bool(hf.get("weight_tying", False)) and not fields["tie_embeddings"]


def _llama_like_fields(hf: dict, tensors: Mapping[str, Any], source: str, *, plain_tie: bool) -> tuple[dict, bool]:
  """Llama, Qwen2, Qwen3 and Dream config.json keys. `plain_tie`: a tied head is our
  tied head without the logit scale (else, Dream's convention, an explicit copy)."""
  _need(hf, "hidden_act", "silu", source)
  if hf.get("use_sliding_window"):
    raise InteropError(f"{source}: use_sliding_window=true is not supported")
  if hf.get("mlp_bias"):
    raise InteropError(f"{source}: mlp_bias=true is not supported")
  rope = hf.get("rope_parameters") or {}
  try:
    scaling = RopeScaling.from_hf(hf)
  except ValueError as e:
    raise InteropError(f"{source}: {e}") from None
  if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
    raise InteropError(f"{source}: partial_rotary_factor != 1 is not supported")
  heads = _get(hf, "num_attention_heads", source)
  d = _get(hf, "hidden_size", source)
  tied = bool(hf.get("tie_word_embeddings", False))
  fields = dict(num_layers=_get(hf, "num_hidden_layers", source), embed_dim=d, num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=-1 if hf.get("head_dim") in (None, d // heads) else hf["head_dim"],
                mlp_dim=_get(hf, "intermediate_size", source),
                rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=plain_tie and tied,
                scale_tied_logits=False if plain_tie else True,
                qkv_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
                qk_norm="model.layers.0.self_attn.q_norm.weight" in tensors,
                rope_scaling=dataclasses.asdict(scaling))
  return fields, tied and not plain_tie


def _llama_fields(hf, tensors, source):
  if hf.get("attention_bias"):
    raise InteropError(f"{source}: attention_bias=true (a bias on o_proj too) is not supported")
  return _llama_like_fields(hf, tensors, source, plain_tie=True)


def _qwen3_fields(hf, tensors, source):
  if hf.get("attention_bias"):
    raise InteropError(f"{source}: attention_bias=true (a bias on o_proj too) is not supported")
  if "model.layers.0.self_attn.q_norm.weight" not in tensors:
    raise InteropError(f"{source}: a Qwen3 model needs model.layers.0.self_attn.q_norm.weight")
  return _llama_like_fields(hf, tensors, source, plain_tie=True)


def _qwen2_fields(hf, tensors, source):
  return _llama_like_fields(hf, tensors, source, plain_tie=True)


def _dream_fields(hf, tensors, source):
  return _llama_like_fields(hf, tensors, source, plain_tie=False)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its config.json model_type, tensor names and config reader.

  causal: an autoregressive model (read with objective "ar"); else a diffusion
  model. exportable: `export --format=NAME` writes this layout. gguf_arch:
  the `general.architecture` of its GGUF files (None: not read from GGUF);
  gguf_permuted_qk: llama.cpp's converter interleaved the q/k rows for its
  adjacent-pair RoPE (Llama), which reading undoes."""

  name: str
  model_type: str
  names: Mapping[str, str]
  fields: Callable[[dict, Mapping[str, Any], str], tuple[dict, bool]]
  causal: bool
  exportable: bool = False
  gguf_arch: str | None = None
  gguf_permuted_qk: bool = False


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llada", "llada", LLADA_NAMES, _llada_fields, causal=False, exportable=True),
    Family("dream", "dream", LLAMA_NAMES, _dream_fields, causal=False, exportable=True),
    Family("llama", "llama", LLAMA_NAMES, _llama_fields, causal=True, gguf_arch="llama", gguf_permuted_qk=True),
    Family("qwen2", "qwen2", LLAMA_NAMES, _qwen2_fields, causal=True, gguf_arch="qwen2"),
    Family("qwen3", "qwen3", LLAMA_NAMES, _qwen3_fields, causal=True, gguf_arch="qwen3"),
)}
EXPORT_FORMATS = tuple(n for n, f in FAMILIES.items() if f.exportable)


def by_gguf_arch(arch: str) -> Family | None:
  return next((f for f in FAMILIES.values() if f.gguf_arch and f.gguf_arch == arch), None)


def by_model_type(model_type: str) -> Family | None:
  return next((f for f in FAMILIES.values() if f.model_type == str(model_type).lower()), None)


def pattern(native: str) -> tuple[str, str | None]:
  """("blocks.{i}.attn.wq", "3") for "blocks.3.attn.wq"; (native, None) outside the blocks."""
  parts = native.split(".")
  if parts[0] == "blocks" and len(parts) > 1:
    return ".".join(["blocks", "{i}", *parts[2:]]), parts[1]
  return native, None


def tensor_name(family: Family, native: str) -> tuple[str, str]:
  """(the family's tensor name, transform) of our parameter path `native`."""
  key, i = pattern(native)
  if key not in family.names or key not in KINDS:
    raise InteropError(f"parameter {native} has no {family.name} name")
  return family.names[key].replace("{i}", str(i)), KINDS[key]
