"""The network: the Flax NNX transformer (bidirectional for masked diffusion,
causal for the AR twin), its layers, the fixed-shape KV cache, the dtype
policy and the weight layouts decoding reads. Every parameter and activation
carries logical axis names (`parallel` maps them to the mesh)."""

from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.model.layers import FEW_ROWS, WEIGHT_LAYOUTS
from mdlm_jax.model.precision import LOGITS_DTYPE, PARAM_DTYPE, STATS_DTYPE, compute_dtype
from mdlm_jax.model.spec import (ModelSpec, bind, decoding_pair, for_decoding, init_params, model_spec,
                                 with_weight_layout)
from mdlm_jax.model.transformer import ModelConfig, Transformer, convert_weight_layout, count_params

__all__ = ["KVCache", "FEW_ROWS", "WEIGHT_LAYOUTS", "LOGITS_DTYPE", "PARAM_DTYPE", "STATS_DTYPE", "compute_dtype",
           "ModelSpec", "bind", "decoding_pair", "for_decoding", "init_params", "model_spec", "with_weight_layout",
           "ModelConfig", "Transformer", "convert_weight_layout", "count_params"]
