"""Pure-jnp multi-head attention: the reference every attention kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def attention_reference(
    q: Float[Array, "b l h d"],
    k: Float[Array, "b s g d"],
    v: Float[Array, "b s g d"],
    *,
    causal: bool = False,
    mask: Bool[Array, "b #h l s"] | None = None,
    scale: float | None = None,
) -> Float[Array, "b l h d"]:
  """Softmax attention with scores and softmax in float32.

  k/v may have fewer heads than q (grouped-query attention): `h` must be a
  multiple of `g`. `mask` (True = attend) is combined with `causal`.
  """
  b, l, h, d = q.shape
  g = k.shape[2]
  if h % g:
    raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({g})")
  scale = d ** -0.5 if scale is None else scale
  qg = q.reshape(b, l, g, h // g, d)
  scores = jnp.einsum("blgrd,bsgd->bgrls", qg, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  s = k.shape[1]
  allowed = None
  if causal:
    # Queries are the last l positions of the s keys (a KV-cache prefix comes first).
    allowed = jnp.arange(s)[None, :] <= (jnp.arange(l)[:, None] + (s - l))
  if mask is not None:
    m = mask.reshape(mask.shape[0], -1, 1, l, s) if mask.shape[1] == 1 else mask.reshape(
        mask.shape[0], g, h // g, l, s)
    allowed = m if allowed is None else jnp.logical_and(allowed, m)
  if allowed is not None:
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bgrls,bsgd->blgrd", probs.astype(v.dtype), v)
  return out.reshape(b, l, h, d)
