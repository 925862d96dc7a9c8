"""The dtype policy, in one place.

Parameters are stored in float32. Matmuls run in the configured compute dtype
(bfloat16 on accelerators, float32 on CPU). Normalisation statistics, attention
softmax, logits and losses are always float32.
"""

import jax.numpy as jnp

from mdlm_jax.kernels.numerics import LOGITS_DTYPE, NEG_INF  # noqa: F401  (part of the policy)

PARAM_DTYPE = jnp.float32
STATS_DTYPE = jnp.float32


def compute_dtype(name: str):
  try:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]
  except KeyError:
    raise ValueError(f"unknown compute dtype {name!r}") from None
