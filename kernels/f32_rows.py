"""Products of a few float32 token rows with a weight stored [out, in], on CPU.

XLA:CPU streams such a weight once for one token row, but from two rows on its
matrix product costs more with every row: on an AVX2 CPU a revising pass of
seven rows took 2.5 times a one-row step in the MLP's products, so float32
revision there ran barely faster than its base. `f32_rows.cc` reads each
weight row once for a group of up to eight token rows (the groups after the
first read it from cache), and sums each row the same way whatever rows sit
beside it: a row's product has the same bits in an AR step as in a revising
pass. It serves up to `MAX_ROWS` rows (an engine's two slots of a revising
pass): on that CPU the MLP's gate and up, [3,072, 576], took 0.73 ms at 16
rows against XLA's 0.99, and at 64 rows 2.3 against 1.9.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from mdlm_jax.kernels import int8

MAX_ROWS = 16


def serves(x2d, w_out_in, preferred_element_type=None) -> bool:
  """Whether the kernel forms this product: on CPU where the kernels build
  vectorized (`int8.f32_rows_ready`), float32 operands, 1 to `MAX_ROWS`
  token rows, a float32 result, no device mesh of more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  return (jax.default_backend() == "cpu" and x2d.ndim == 2 and w_out_in.ndim == 2
          and 1 <= x2d.shape[0] <= MAX_ROWS and x2d.shape[1] == w_out_in.shape[1]
          and x2d.dtype == jnp.float32 and w_out_in.dtype == jnp.float32
          and preferred_element_type in (None, jnp.float32, np.float32)
          and (mesh is None or mesh.empty or mesh.size == 1) and int8.f32_rows_ready())


@jax.custom_jvp
def matmul(x2d: Float[Array, "m k"], w_out_in: Float[Array, "n k"]) -> Float[Array, "m n"]:
  """x2d [m, k] times w [n, k] transposed: [m, n] (m <= MAX_ROWS)."""
  if not int8.native_kernel_ready():
    raise RuntimeError("the CPU kernels could not be built: call kernels.out_in_matmul, which then takes XLA's path")
  out = jax.ShapeDtypeStruct((x2d.shape[0], w_out_in.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(int8.F32_ROWS_FFI_TARGET, out)(x2d, w_out_in)


@matmul.defjvp
def _matmul_jvp(primals, tangents):  # an FFI call has no derivatives: the product's own, through XLA
  (x, w), (dx, dw) = primals, tangents
  return matmul(x, w), jnp.einsum("mk,nk->mn", dx, w) + jnp.einsum("mk,nk->mn", x, dw)
