"""Model construction: abstract shapes, sharded initialisation, weight layouts.

Parameters live as a pure dict of arrays (the shape orbax and optax like);
`bind` turns them back into an nnx module inside or outside jit. Functions
that take a loaded model accept anything with `spec` and `params` fields
(`checkpoints.LoadedModel`) and hand back a copy of it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mdlm_jax import kernels
from mdlm_jax.model.layers import ParamKeys
from mdlm_jax.model.transformer import (DECODE_DTYPE_CHOICES, INT8_ACTIVATION_BITS, ModelConfig, Transformer,
                                        adapters_fit_bfloat16, convert_weight_layout, quantize_for_decoding)
from mdlm_jax.model.stacked import stack_blocks
from mdlm_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Everything needed to rebuild the module around a params dict."""

  cfg: ModelConfig
  graphdef: Any
  abstract: Any  # pure dict of ShapeDtypeStruct
  shardings: Any  # pure dict of NamedSharding (None without a mesh)


def model_spec(cfg: ModelConfig, mesh: Mesh | None) -> ModelSpec:
  abstract_model = nnx.eval_shape(lambda: Transformer(cfg, rngs=ParamKeys(0)))
  graphdef, state = nnx.split(abstract_model)
  shardings = nnx.to_pure_dict(sharding.param_shardings(state, mesh)) if mesh is not None else None
  return ModelSpec(cfg, graphdef, nnx.to_pure_dict(state), shardings)


def init_params(spec: ModelSpec, seed: int | jax.Array, only: frozenset[str] | None = None):
  """Initialises directly into the sharded layout (no full host copy).

  `only`: the parameters named (`jax.tree_util.keystr` of their paths) and no
  others, as {name: array}: the program computes just those, so fresh
  adapters over an imported base compile and run in moments (the whole
  model's random initialisation compiled for minutes on a GPU)."""

  def init():
    return nnx.to_pure_dict(nnx.state(Transformer(spec.cfg, rngs=ParamKeys(seed))))

  if only is None:
    return jax.jit(init, out_shardings=spec.shardings)()
  names = sorted(only)
  flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(spec.abstract)[0]}
  unknown = [n for n in names if n not in flat]
  if unknown:
    raise ValueError(f"init_params: the model has no parameters {unknown}")
  shardings = None
  if spec.shardings is not None:
    by_name = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(spec.shardings)[0]}
    shardings = {n: by_name[n] for n in names}

  def some():
    full = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(init())[0]}
    return {n: full[n] for n in names}

  return jax.jit(some, out_shardings=shardings)()


def zero_params(spec: ModelSpec):
  """Zeros in the params' shapes and sharded layout: what a resumed run
  restores its checkpoint into, without compiling the whole model's random
  initialisation (minutes on a GPU)."""
  return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), spec.abstract),
                 out_shardings=spec.shardings)()


def with_weight_layout(loaded: Any, layout: str) -> Any:
  """The same model with its matmul weights stored in `layout` (a copy on the
  same devices and shardings; the input is unchanged)."""
  cfg = loaded.spec.cfg
  if cfg.weight_layout == layout:
    return loaded
  first = jax.tree.leaves(loaded.params)[0].sharding
  spec = model_spec(dataclasses.replace(cfg, weight_layout=layout),
                    first.mesh if isinstance(first, jax.sharding.NamedSharding) else None)
  convert = functools.partial(convert_weight_layout, cfg=cfg, to=layout)
  params = jax.jit(convert, out_shardings=spec.shardings)(loaded.params)
  return dataclasses.replace(loaded, spec=spec, params=params)


def next_token_view(loaded: Any) -> Any:
  """A causal (AR) model as the block decoders see a model with a shifted head:
  the same params, with position i scored by the state of i - 1 (shift_logits).
  Decoded in blocks of one token against the KV cache, a pass then commits
  exactly the token AR decoding would (the masked query's own state is never
  read), so every diffusion serving path serves an AR checkpoint unchanged."""
  cfg = loaded.spec.cfg
  if not cfg.causal:
    raise ValueError("next_token_view takes a causal (AR) model")
  if cfg.shift_logits:
    return loaded
  first = jax.tree.leaves(loaded.params)[0].sharding
  spec = model_spec(dataclasses.replace(cfg, shift_logits=True),
                    first.mesh if isinstance(first, jax.sharding.NamedSharding) else None)
  return dataclasses.replace(loaded, spec=spec)


def resolve_decode_dtype(loaded: Any, decode_dtype: str, layout: str | None = None) -> str:
  """`decode_dtype` itself, or for "auto" the one this model decodes fastest
  in where its params live: "w8a8" on one CPU device where the C++ int8
  kernels build with their vector paths (SmolLM2-135M's AR step 1.8x
  llama.cpp's Q4_1 there, against 0.4x in float32; the text moves by
  rounding only, see docs/weight-layouts.md), else "float32": the kernels'
  portable loops (an AVX2 CPU) run a pass of several rows at half float32's
  speed or less, an accelerator's products run in
  the model's own dtype, XLA:CPU's convert-then-dot without the kernels runs
  a one-row pass 8-9x slower than float32, and an int8 copy holds neither a
  model sharded over devices nor a layout other than "out_in"."""
  if decode_dtype not in DECODE_DTYPE_CHOICES:
    raise ValueError(f"unknown decode dtype {decode_dtype!r}; choose from {DECODE_DTYPE_CHOICES}")
  if decode_dtype != "auto":
    return decode_dtype
  first = jax.tree.leaves(loaded.params)[0]
  devices = first.sharding.device_set
  one_cpu = len(devices) == 1 and next(iter(devices)).platform == "cpu"
  if one_cpu and layout in (None, "out_in") and kernels.int8.kernels_vectorized():
    return "w8a8"
  return "float32"


def for_decoding(loaded: Any, layout: str | None = None, decode_dtype: str = "float32") -> Any:
  """The model in weight layout `layout`, by default the one that decodes
  fastest where its params live: "out_in" on CPU (a few token rows per pass
  read an [out, in] weight up to 2.5x faster there), as loaded elsewhere.
  `decode_dtype="int8"` stores the matmul weights in weight-only int8
  (`with_int8_weights`; the layout is then "out_in"); "w8a8" the same
  weights, their products rounding token rows to 8 bits in groups; "auto"
  whichever `resolve_decode_dtype` picks."""
  decode_dtype = resolve_decode_dtype(loaded, decode_dtype, layout)
  if decode_dtype in INT8_ACTIVATION_BITS:
    if layout not in (None, "out_in"):
      raise ValueError(f"int8 decoding weights are stored [out, in]; weight layout {layout!r} cannot hold them")
    return with_int8_weights(with_weight_layout(loaded, "out_in"), activation_bits=INT8_ACTIVATION_BITS[decode_dtype])
  if layout is None:
    platform = next(iter(jax.tree.leaves(loaded.params)[0].devices())).platform
    layout = "out_in" if platform == "cpu" else loaded.spec.cfg.weight_layout
  return with_weight_layout(loaded, layout)


def with_int8_weights(loaded: Any, activation_bits: int = 16) -> Any:
  """The same "out_in" model with int8 matmul weights (`quantize_for_decoding`),
  on its one device, each kind of the blocks' arrays in one stack
  (`stacked.stack_blocks`): a copy made once, for decoding only."""
  first = jax.tree.leaves(loaded.params)[0].sharding
  if isinstance(first, jax.sharding.NamedSharding) and first.mesh.size > 1:
    raise ValueError("int8 decoding weights are for one device; this model is sharded over"
                     f" {first.mesh.size} devices")
  cfg = loaded.spec.cfg
  params = jax.jit(int8_quantizer(loaded.params, cfg, activation_bits))(loaded.params)
  spec = loaded.spec
  if cfg.lora_rank:  # the adapters now live in the int8 weights
    spec = model_spec(dataclasses.replace(cfg, adapters_joined=True),
                      first.mesh if isinstance(first, jax.sharding.NamedSharding) else None)
  return dataclasses.replace(loaded, spec=spec, params=stack_blocks(params))


def int8_quantizer(params: Any, cfg: ModelConfig, activation_bits: int):
  """`quantize_for_decoding` of these "out_in" params with their adapters in
  bfloat16 where that holds them exactly (`adapters_fit_bfloat16`, checked
  on the host): the decoding copy `with_int8_weights` makes, and the one a
  benchmark counts the bytes of."""
  adapter_dtype = jnp.bfloat16 if adapters_fit_bfloat16(params, cfg) else jnp.float32
  return functools.partial(quantize_for_decoding, cfg=cfg, activation_bits=activation_bits,
                           adapter_dtype=adapter_dtype)


def decoding_pair(loaded: Any, layout: str | None = None, decode_dtype: str = "float32") -> tuple[Any, Any]:
  """(model for passes over few token rows, model for more): both in `layout`
  when given; else, on CPU, the [out, in] copy (int8 with `decode_dtype`) and
  the trained layout in float32 (past layers.FEW_ROWS rows the trained layout
  is the faster, and a long prompt's prefill stays exact); elsewhere as loaded.
  Resolve an "auto" `decode_dtype` first (`resolve_decode_dtype`) to know
  which the few-rows copy holds."""
  few = for_decoding(loaded, layout, decode_dtype)
  if layout is not None or few is loaded:
    return few, few
  return few, with_weight_layout(loaded, "in_out")


def bind(spec: ModelSpec, params) -> Transformer:
  return nnx.merge(spec.graphdef, params)
