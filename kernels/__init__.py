"""Attention and other hot-path ops, dispatched by backend and config.

The model calls only the functions exported here. Each op has a pure-jnp
reference (`*_reference`) that is the fallback on every backend.
"""

from mdlm_jax.kernels.attention_reference import attention_reference

IMPLEMENTATIONS = ("xla",)


def attention(q, k, v, *, causal=False, mask=None, implementation="xla"):
  """Dispatches multi-head attention; see `attention_reference` for shapes."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown attention implementation {implementation!r}; choose from {IMPLEMENTATIONS}")
  return attention_reference(q, k, v, causal=causal, mask=mask)


__all__ = ["attention", "attention_reference", "IMPLEMENTATIONS"]
