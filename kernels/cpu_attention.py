"""Attention of a decoding pass's few queries over the KV cache, on CPU.

Through XLA:CPU a pass's attention over a short cache was a copy of each
layer's keys and values out of the buffer, then small dots and softmax
fusions, each an operation with its own dispatch: about a fifth of a
revising pass of the packaged default, though the arithmetic is a few
million multiply-adds a layer. `cache_attention.cc` (built with the int8
kernel, `int8.native_kernel_ready`) does it in one call that reads the
layer's buffer in place, each query up to the end its mask allows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from mdlm_jax.kernels import int8
from mdlm_jax.kernels.masks import AttentionMask

# Up to this many queries a call serves: a decoding pass's rows, and the
# prefills the int8 products serve (`int8.KERNEL_MAX_ROWS`), so that a prompt's
# keys and values are the same bits however the prompt sits in the cache (XLA's
# attention sums over the buffer's shape, and the int8 rounding of token rows
# makes other tokens of the ulps between two shapes).
MAX_QUERIES = int8.KERNEL_MAX_ROWS


def serves(q, k_cache, v_cache, layer, mask, implementation: str) -> bool:
  """Whether the kernel runs this `cache_attention` call: on CPU, built with
  its vector paths (`int8.attention_ready`: AVX2 with FMA, or AVX-512; its
  portable loop is slower than XLA's dots at every shape measured), float32,
  every layer's buffer with `layer` given, a prefix mask without segments,
  few queries, no device mesh of more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  return (implementation == "xla" and jax.default_backend() == "cpu" and layer is not None
          and isinstance(mask, AttentionMask) and mask.kind == "prefix" and not mask.has_segments
          and q.ndim == 4 and k_cache.ndim == 5 and q.shape[1] <= MAX_QUERIES
          and all(x.dtype == jnp.float32 for x in (q, k_cache, v_cache))
          and (mesh is None or mesh.empty or mesh.size == 1) and int8.attention_ready())


def cpu_cache_attention(q: Float[Array, "b l h d"], k_cache: Float[Array, "n B g d s"],
                        v_cache: Float[Array, "n B g s d"], layer: int, mask: AttentionMask) -> Float[Array, "b l h d"]:
  """Softmax attention of q over layer `layer` of the cache buffers (their
  first b rows), query i reading slot j where `mask.kv_valid[j]` and j <
  `mask.q_end[i]`; float32 scores; a query that may read no slot gets
  zeros."""
  if not int8.native_kernel_ready():
    raise RuntimeError("the CPU kernels could not be built: call kernels.cache_attention, which then takes XLA's path")
  b, l, _, d = q.shape
  s = v_cache.shape[-2]
  q_end = jnp.broadcast_to(mask.q_end, (b, l)).astype(jnp.int32)
  kv_valid = (jnp.ones((b, s), jnp.bool_) if mask.kv_valid is None
              else jnp.broadcast_to(mask.kv_valid, (b, s)).astype(jnp.bool_))
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  return jax.ffi.ffi_call(int8.ATTENTION_FFI_TARGET, out)(q, k_cache, v_cache, q_end, kv_valid,
                                                          layer=np.int64(layer), scale=np.float32(d ** -0.5))


def with_derivatives_of(xla_path, layer: int):
  """`cpu_cache_attention` whose derivatives are those of `xla_path(q,
  k_cache, v_cache, mask)`, the same attention through XLA: an FFI call has
  no derivatives, and training through a cache (a two-pass step over a
  trained base) differentiates the attention it runs."""

  @jax.custom_jvp
  def attend(q, k_cache, v_cache, mask):
    return cpu_cache_attention(q, k_cache, v_cache, layer, mask)

  @attend.defjvp
  def attend_jvp(primals, tangents):
    out, tangent = jax.jvp(xla_path, primals, tangents)
    q, _, v_cache, mask = primals
    b, s = q.shape[0], v_cache.shape[-2]
    kv_valid = (jnp.ones((b, s), jnp.bool_) if mask.kv_valid is None
                else jnp.broadcast_to(mask.kv_valid, (b, s)).astype(jnp.bool_))
    q_end = jnp.broadcast_to(mask.q_end, q.shape[:2])
    reads = jnp.any(kv_valid[:, None, :] & (jnp.arange(s) < q_end[..., None]), axis=-1)[..., None, None]
    # A query that may read no slot: zeros, as the kernel gives (XLA's softmax gives the values' mean).
    return jnp.where(reads, out, 0.0), jnp.where(reads, tangent, 0.0)

  return attend

