"""Numeric conventions the kernels share with the model and the samplers,
kept here, at the bottom of the dependency graph, so kernels import nothing
above them.

- LOGITS_DTYPE: logits and softmax statistics are float32 on every backend.
- NEG_INF: a finite "minus infinity" for excluded logits (0 * NEG_INF stays
  0 under autodiff, where -inf would give NaN).
- gumbel_float32: the float32 Gumbel noise both the fused confidence head and
  the samplers' float32 path draw from the same random bits.
"""

import jax
import jax.numpy as jnp
import numpy as np

LOGITS_DTYPE = jnp.float32
NEG_INF = -1e9


def gumbel_float32(hi: jax.Array) -> jax.Array:
  """Gumbel noise from the top 23 bits of a uint32 word."""
  u = ((hi >> 9).astype(jnp.float32) + 0.5) * np.float32(2.0**-23)  # in [2^-24, 1 - 2^-24]
  return -jnp.log(-jnp.log(u))
