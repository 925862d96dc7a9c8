"""Attention and other hot-path ops, dispatched by backend and config.

The model and the samplers call only the functions exported here. Each op has
a pure-jnp reference (`*_reference`) that is the fallback on every backend.

Implementations:
- "xla": plain XLA, everywhere: the reference for a few queries (decoding),
  and from CHUNKED_FROM queries (or a KV cache of CHUNKED_CACHE_FROM slots)
  the chunked online-softmax attention, whose memory grows linearly with the
  sequence (forward and backward). `cache_attention` reads a long KV cache
  in its stored layout, in place, and a shorter one up to a power-of-two
  span past the furthest filled slot, so a decoding pass costs about the
  filled prefix, not the whole buffer. On CPU a decoding pass's few queries
  over the cache take one C++ call a layer instead (`cpu_attention.py`).
- "pallas": the Pallas kernel for the running backend on GPU (Triton) and TPU
  (Mosaic); "xla" elsewhere (CPU), since interpreted kernels are slow.
- "pallas_interpret": the Pallas kernel (GPU variant) under the Pallas
  interpreter on any backend: how tests run the kernels on CPU.
Under a mesh whose `sequence` axis is larger than 1, attention over a sharded
sequence runs `sequence_parallel_attention` (gathered keys and values, the
chunked attention per device) for every implementation but "reference".
Attention also takes "reference": the materialised [L, S] reference at
every length (comparisons; its memory grows with the square of the length).
The confidence head also takes "triton": the jax-triton kernel on a CUDA
backend (the `gpu` extra), the reference elsewhere.

Weight-only int8 decoding weights (`QuantizedWeight`, `int8_matmul`, with
low-rank adapters joined in by `join_adapters`) multiply in a C++ kernel on
CPU through the XLA FFI (`int8.py`), XLA elsewhere; so do a few float32 token
rows against a weight stored [out, in] (`out_in_matmul`, `f32_rows.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from mdlm_jax.kernels.attention_reference import attention_reference
from mdlm_jax.kernels.chunked_attention import chunked_attention, chunked_cache_attention
from mdlm_jax.kernels.confidence_head import (HeadBlockSizes, HeadSettings, confidence_head_pallas,
                                              confidence_head_reference)
from mdlm_jax.kernels.flash_attention import BlockSizes, flash_attention
from mdlm_jax.kernels import cpu_attention, f32_rows
from mdlm_jax.kernels.int8 import (LowRank, QuantizedWeight, int8_matmul, join_adapters, kernels_vectorized,
                                   native_kernel_ready, products_use_amx, quantize, stack_layers, tile_weights,
                                   untile_weights)
from mdlm_jax.kernels.masks import AttentionMask, MaskSpec, resolve
from mdlm_jax.kernels.sequence_parallel import sequence_parallel_attention, sequence_shards
from mdlm_jax.kernels.numerics import LOGITS_DTYPE

IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret")
ATTENTION_IMPLEMENTATIONS = IMPLEMENTATIONS + ("reference",)
HEAD_IMPLEMENTATIONS = IMPLEMENTATIONS + ("triton",)


def kernel_backend() -> str | None:
  """"gpu" or "tpu" when the default backend runs Pallas kernels natively, else None."""
  backend = jax.default_backend()
  if backend in ("gpu", "cuda", "rocm"):
    return "gpu"
  return "tpu" if backend == "tpu" else None


def _check(implementation: str) -> None:
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"unknown attention implementation {implementation!r}; choose from {ATTENTION_IMPLEMENTATIONS}")


def _kernel_target(implementation: str) -> tuple[str, bool] | None:
  """(variant, interpret) of the kernel to run, or None for the reference."""
  if implementation == "pallas_interpret":
    return "gpu", True
  backend = kernel_backend()
  if implementation == "pallas":
    return None if backend is None else (backend, False)
  if implementation == "triton" and backend == "gpu" and jax.default_backend() != "rocm":
    return "triton", False
  return None


# Up to this many rows `out_in_matmul` forms [out, tokens]; beyond, [tokens,
# out]. Past it the trained [in, out] layout is the faster on XLA:CPU
# (measured), which is where the generator and the engine switch to it.
FEW_ROWS = 64


def out_in_matmul(x2d, w_out_in, preferred_element_type=None):
  """x2d [tokens, in] times a weight stored [out, in]: [tokens, out].

  Against a few token rows (decoding) XLA:CPU forms [out, tokens] from such a
  weight up to 2.5x faster than [tokens, out] from an [in, out] one,
  streaming each weight row once; the barrier keeps XLA from folding the
  transpose back into the product."""
  rows = x2d.shape[0]
  if f32_rows.serves(x2d, w_out_in, preferred_element_type):  # each weight row read once for every token row
    return f32_rows.matmul(x2d, w_out_in)
  if rows > FEW_ROWS:
    return jax.numpy.einsum("mk,nk->mn", x2d, w_out_in, preferred_element_type=preferred_element_type)
  product = jax.numpy.einsum("nk,mk->nm", w_out_in, x2d, preferred_element_type=preferred_element_type)
  if rows == 1:  # [out, 1] and [1, out] are the same bytes
    return product.reshape(1, -1)
  return jax.lax.optimization_barrier(product).T


@struct.dataclass
class HeadInput:
  """What the vocabulary head reads: final hidden states (already scaled as
  the model's `logits` scales them) and the output embedding. A model returns
  this instead of logits when a sampler asks for the fused head."""

  hidden: Float[Array, "b t d"]
  w: Float[Array, "d v"] | Float[Array, "v d"] | QuantizedWeight  # [v, d] with out_in (int8: always)
  implementation: str = struct.field(pytree_node=False, default="xla")
  out_in: bool = struct.field(pytree_node=False, default=False)

  @property
  def w_dv(self) -> Float[Array, "d v"]:
    """The output embedding as [d, v], the kernels' operand."""
    w = self.w.dequantize() if isinstance(self.w, QuantizedWeight) else self.w
    return w.T if self.out_in else w

  def logits(self) -> Float[Array, "b t v"]:
    b, t, d = self.hidden.shape
    if isinstance(self.w, QuantizedWeight):  # int8 decoding weights, [v, d]
      return int8_matmul(self.hidden.reshape(b * t, d), self.w).astype(LOGITS_DTYPE).reshape(b, t, -1)
    h2, w = self.hidden.reshape(b * t, d), self.w.astype(self.hidden.dtype)
    matmul = out_in_matmul if self.out_in else jax.numpy.matmul
    return matmul(h2, w, preferred_element_type=LOGITS_DTYPE).reshape(b, t, -1)

  @property
  def fused(self) -> bool:
    """Whether `confidence_head` runs a kernel here (else: materialise the logits)."""
    return _kernel_target(self.implementation) is not None


def confidence_head(hidden, w, bits, settings: HeadSettings = HeadSettings(), *, implementation="xla",
                    block_sizes: HeadBlockSizes | None = None):
  """(token, p(token), max p) per position without materialising [b, t, v]
  logits; see `confidence_head_reference`. "triton" runs the jax-triton
  kernel on CUDA; "pallas" the Pallas kernel on GPU/TPU; the reference elsewhere."""
  if implementation not in HEAD_IMPLEMENTATIONS:
    raise ValueError(f"unknown confidence head implementation {implementation!r}; choose from {HEAD_IMPLEMENTATIONS}")
  target = _kernel_target(implementation)
  if target is None:
    return confidence_head_reference(hidden, w, bits, settings)
  backend, interpret = target
  if backend == "triton":
    from mdlm_jax.kernels.confidence_head_triton import confidence_head_triton
    return confidence_head_triton(hidden, w, bits, settings, block_sizes=block_sizes)
  return confidence_head_pallas(hidden, w, bits, settings, block_sizes=block_sizes, backend=backend,
                                interpret=interpret)


# From this many queries "xla" runs the chunked attention: on CPU it keeps
# pace with the reference from a few hundred tokens and pulls ahead with
# length (`bench longctx`), and its memory stays linear in the length.
CHUNKED_FROM = 256
# A KV cache this long is read by the chunked attention even for a few
# queries (decoding passes): it stops at the filled prefix's last tile, where
# the reference scores every slot of the buffer.
CHUNKED_CACHE_FROM = 4096


def attention(q, k, v, *, causal=False, mask=None, implementation="xla", block_sizes: BlockSizes | None = None):
  """Multi-head attention; shapes as `attention_reference`.

  `mask` is None, a structural `AttentionMask` (the kernels and the chunked
  attention compute it per tile and skip empty tiles), or a dense boolean
  array, which has no structure to use and always runs the reference. Under
  a device mesh the kernel runs per shard (`shard_map` over batch and heads).
  A query that may read no key gets zeros (the reference: the mean value).
  """
  _check(implementation)
  target = _kernel_target(implementation)
  dense = mask is not None and not isinstance(mask, AttentionMask)
  mesh = jax.sharding.get_abstract_mesh()
  if not dense and implementation != "reference" and sequence_shards(mesh, q.shape[1], k.shape[1]) > 1:
    batch, heads = _shard_axes(mesh, q, k)
    mask = resolve(mask, causal, q.shape, k.shape)
    return sequence_parallel_attention(q, k, v, mask, mesh=mesh, batch=batch, heads=heads)
  if target is None or dense:
    long_cache = isinstance(mask, AttentionMask) and mask.kind == "prefix" and k.shape[1] >= CHUNKED_CACHE_FROM
    if (q.shape[1] >= CHUNKED_FROM or long_cache) and not dense and implementation != "reference":
      return chunked_attention(q, k, v, mask, causal=causal)
    return attention_reference(q, k, v, causal=causal, mask=mask)
  backend, interpret = target
  mask = (mask if mask is not None else AttentionMask()).with_causal(causal)

  def run(q, k, v, mask):
    return flash_attention(q, k, v, mask, block_sizes=block_sizes, backend=backend, interpret=interpret)

  return _per_shard(run, q, k, v, mask)


def cache_attention(q, k_cache, v_cache, *, layer=None, causal: bool = False,
                    mask: "AttentionMask | None" = None, implementation="xla", block_sizes: BlockSizes | None = None):
  """`attention` of new queries over a KV cache as it is stored: keys
  [b, g, d, s], values [b, g, s, d], or every layer's ([n, ...], `KVCache.k`
  and `.v`) with `layer` the one to read; the queries' b rows read the
  buffers' first b rows. Where the chunked attention would
  read a long cache, it reads these buffers in place, up to the filled
  prefix's last tile. Otherwise `attention` over [b, s, g, d] views of the
  layer, cut to the shortest of `read_spans(s)` that holds every slot a
  query may read (a "prefix" mask's furthest end, found on the device): a
  decoding pass early in a long buffer reads and copies its filled start,
  not the whole buffer, and compiles one branch per span."""
  if not causal and cpu_attention.serves(q, k_cache, v_cache, layer, mask, implementation):
    xla_path = functools.partial(_xla_cache_attention, layer=layer, causal=False, implementation=implementation,
                                 block_sizes=block_sizes)
    return cpu_attention.with_derivatives_of(xla_path, layer)(q, k_cache, v_cache, mask)
  return _xla_cache_attention(q, k_cache, v_cache, mask, layer=layer, causal=causal, implementation=implementation,
                              block_sizes=block_sizes)


def _xla_cache_attention(q, k_cache, v_cache, mask, *, layer, causal, implementation, block_sizes):
  mesh = jax.sharding.get_abstract_mesh()
  s = v_cache.shape[-2]
  prefix = not causal and isinstance(mask, AttentionMask) and mask.kind == "prefix"
  on_xla = implementation != "reference" and _kernel_target(implementation) is None
  unsharded = sequence_shards(mesh, q.shape[1], s) <= 1
  if prefix and on_xla and unsharded and s >= CHUNKED_CACHE_FROM:
    return chunked_cache_attention(q, k_cache, v_cache, mask, layer=layer)
  b = q.shape[0]

  def read(span, q, k_cache, v_cache, mask):
    if layer is not None:
      k_cache, v_cache = k_cache[layer], v_cache[layer]
    k_cache, v_cache = k_cache[:b, :, :, :span], v_cache[:b, :, :span]
    if isinstance(mask, AttentionMask) and mask.kv_valid is not None:
      mask = mask.replace(kv_valid=mask.kv_valid[:, :span])
    return attention(q, k_cache.transpose(0, 3, 1, 2), v_cache.transpose(0, 2, 1, 3), causal=causal, mask=mask,
                     implementation=implementation, block_sizes=block_sizes)

  spans = read_spans(s) if prefix and on_xla and unsharded else (s,)
  if len(spans) == 1:
    return read(s, q, k_cache, v_cache, mask)
  reach = jnp.max(mask.q_end)  # one past the furthest slot any query reads
  index = jnp.sum(reach > jnp.asarray(spans[:-1], jnp.int32))
  return jax.lax.switch(index, [functools.partial(read, span) for span in spans], q, k_cache, v_cache, mask)


# A KV cache buffer shorter than CHUNKED_CACHE_FROM is read up to the first
# of these powers of two (from CACHE_SPAN_MIN) that holds the filled slots.
CACHE_SPAN_MIN = 256


def read_spans(s: int) -> tuple[int, ...]:
  """The lengths `cache_attention` may cut an s-slot buffer to: powers of two
  from CACHE_SPAN_MIN below s, then s."""
  spans, span = [], CACHE_SPAN_MIN
  while span < s:
    spans.append(span)
    span *= 2
  return (*spans, s)


def _shard_axes(mesh, q, k):
  """The mesh axes (or None) that q and k share on their batch and head dims."""
  from mdlm_jax.parallel import sharding
  sizes = dict(mesh.shape)
  qs = sharding.fit_spec(sharding.logical_to_spec(("batch", None, "act_heads", None)), q.shape, sizes)
  ks = sharding.fit_spec(sharding.logical_to_spec(("batch", None, "act_heads", None)), k.shape, sizes)
  heads = qs[2] if qs[2] == ks[2] else None  # GQA groups must split alike
  return (qs[0] if ks[0] == qs[0] else None), heads


def _per_shard(fn, q, k, v, mask: AttentionMask):
  """`fn` under shard_map over the mesh's batch and head axes (a pallas_call
  cannot be partitioned by XLA); a plain call outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.size == 1:
    return fn(q, k, v, mask)
  batch, heads = _shard_axes(mesh, q, k)
  qkv = P(batch, None, heads, None)
  mask_specs = jax.tree.map(lambda x: P(batch if x.shape[0] > 1 else None, *([None] * (x.ndim - 1))), mask)
  return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, mask_specs), out_specs=qkv, check_vma=False)(
      q, k, v, mask)


__all__ = ["attention", "cache_attention", "attention_reference", "chunked_attention", "chunked_cache_attention",
           "CHUNKED_FROM", "CHUNKED_CACHE_FROM", "CACHE_SPAN_MIN", "read_spans",
           "flash_attention", "AttentionMask", "MaskSpec", "BlockSizes", "IMPLEMENTATIONS", "ATTENTION_IMPLEMENTATIONS",
           "HEAD_IMPLEMENTATIONS", "kernel_backend", "confidence_head", "confidence_head_pallas",
           "confidence_head_reference", "HeadInput", "HeadSettings", "HeadBlockSizes",
           "LowRank", "QuantizedWeight", "int8_matmul", "join_adapters", "native_kernel_ready", "kernels_vectorized",
           "products_use_amx", "quantize", "stack_layers", "tile_weights", "untile_weights"]
