"""Rotary position embeddings and the ways to stretch them past the trained context.

A model trained at one context reads positions past it badly: the rotations
of its low frequencies never completed a turn in training. The scalings
Hugging Face names under `rope_scaling` (`rope_parameters` in newer configs)
change the frequencies, and the imported checkpoints that use them decode
only if they are computed exactly as `transformers` computes them:
- "linear" (position interpolation): every frequency divided by `factor`;
- "dynamic" (NTK-aware): the base raised so that the lowest frequency
  stretches over the sequence, from the current length (the largest position
  in the call plus one) once it passes `max_position`;
- "yarn": frequencies that turn many times in the trained context are kept,
  those that turn less than once are interpolated, a linear ramp between,
  and q and k scaled by `attention_factor` (0.1 ln(factor) + 1 by default);
- "llama3": Llama 3.1's wavelength bands (`low_freq_factor`,
  `high_freq_factor`), smoothed between.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """One scaling's settings (hashable: part of the static model config).

  `max_position`: the context the frequencies were trained for (Hugging
  Face's `original_max_position_embeddings`, else `max_position_embeddings`),
  which the dynamic, yarn and llama3 rules measure against. `factor`: the
  stretch (for yarn imported with both context lengths, their ratio, as
  `transformers` computes it)."""

  type: str = "default"
  factor: float = 1.0
  max_position: int = 0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  truncate: bool = True

  def __post_init__(self):
    if self.type not in TYPES:
      raise ValueError(f"rope_scaling type must be one of {TYPES}, got {self.type!r}")
    if self.type != "default" and not self.factor > 0:
      raise ValueError(f"rope_scaling factor must be positive, got {self.factor}")
    if self.type in ("dynamic", "yarn", "llama3") and self.max_position <= 0:
      raise ValueError(f"rope_scaling type {self.type!r} needs max_position (the trained context), got "
                       f"{self.max_position}")
    if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError("rope_scaling llama3 needs high_freq_factor > low_freq_factor")

  @classmethod
  def from_dict(cls, d: dict[str, Any] | None) -> "RopeScaling":
    """From our config's `model.rope_scaling` (the field names; {} for none)."""
    d = dict(d or {})
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown model.rope_scaling keys {sorted(unknown)}")
    return cls(**d)

  @classmethod
  def from_hf(cls, hf: dict[str, Any]) -> "RopeScaling":
    """From a Hugging Face config.json: `rope_scaling` or `rope_parameters`
    with `rope_type` (or the older `type`), and `max_position_embeddings`."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
      return cls()
    if kind not in TYPES:
      raise ValueError(f"rope scaling {kind!r} is not supported (supported: {TYPES[1:]})")
    max_pos = hf.get("max_position_embeddings")
    factor = float(params.get("factor", 1.0))
    trained = params.get("original_max_position_embeddings") or max_pos
    if kind == "yarn" and "original_max_position_embeddings" in params and max_pos:
      factor = max_pos / params["original_max_position_embeddings"]  # as transformers computes it
    if kind == "dynamic":
      trained = max_pos  # transformers measures dynamic scaling against max_position_embeddings
    return cls(type=kind, factor=factor, max_position=int(trained or 0),
               low_freq_factor=float(params.get("low_freq_factor", 1.0)),
               high_freq_factor=float(params.get("high_freq_factor", 4.0)),
               beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
               attention_factor=params.get("attention_factor"), mscale=float(params.get("mscale") or 0.0),
               mscale_all_dim=float(params.get("mscale_all_dim") or 0.0), truncate=bool(params.get("truncate", True)))

  def frequencies(self, dim: int, theta: float) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim / 2] float32, factor on q and k), for every
    type but "dynamic", whose frequencies depend on the length (`rope`)."""
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scale = 1.0
    if self.type == "linear":
      inv = inv / self.factor
    elif self.type == "yarn":
      inv, scale = self._yarn(dim, theta)
    elif self.type == "llama3":
      inv = self._llama3(inv)
    return inv.astype(np.float32), scale

  def _yarn(self, dim: int, theta: float) -> tuple[np.ndarray, float]:
    def mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scale = self.attention_factor
    if scale is None:
      scale = (mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
               if self.mscale and self.mscale_all_dim else mscale(self.factor))

    def turns_dim(rotations):  # the dimension whose frequency turns `rotations` times in the trained context
      return dim * math.log(self.max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_dim(self.beta_fast), turns_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)  # 0: kept, 1: interpolated
    inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return inv / self.factor * ramp + inv * (1 - ramp), float(scale)

  def _llama3(self, inv: np.ndarray) -> np.ndarray:
    low_wavelen = self.max_position / self.low_freq_factor
    high_wavelen = self.max_position / self.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
    smooth = (self.max_position / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
    smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


NONE = RopeScaling()


class Rotation(NamedTuple):
  """cos and sin of every position's angles ([b, l, d/2], float32, any
  attention scaling folded in): what `rope` turns q and k by."""
  cos: Float[Array, "b l f"]
  sin: Float[Array, "b l f"]


def rotation(positions: Int[Array, "b l"], dim: int, theta: float, scaling: RopeScaling = NONE) -> Rotation:
  """The rotation at `positions` for heads of `dim`, computed once for every
  layer of a pass and written out (`_materialized`): otherwise XLA fuses the
  sines into each layer's q and k rotation and computes them again for every
  element of every head (on XLA:CPU about 0.6 ms of a six-column decoding
  pass of SmolLM2-135M, measured)."""
  scale = 1.0
  if scaling.type == "default":
    freqs = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  elif scaling.type == "dynamic":
    length = jnp.maximum(jnp.max(positions) + 1, scaling.max_position).astype(jnp.float32)
    base = theta * ((scaling.factor * length / scaling.max_position) - (scaling.factor - 1)) ** (dim / (dim - 2))
    freqs = 1.0 / base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  else:
    inv, scale = scaling.frequencies(dim, theta)
    freqs = jnp.asarray(inv)
  angles = positions[..., None].astype(jnp.float32) * freqs  # [b, l, d/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if scale != 1.0:
    sin, cos = sin * scale, cos * scale
  return Rotation(_materialized(cos), _materialized(sin))


def _materialized(a: Array) -> Array:
  """`a` itself (adding zeros is exact), as a reduction: XLA fuses an
  elementwise producer into every consumer, and XLA:CPU drops optimization
  barriers before fusing, but it does not fuse a reduction into what reads
  it."""
  return jnp.sum(jnp.stack([a, jnp.zeros_like(a)]), axis=0)


def rope(x: Float[Array, "b l h d"], positions: Int[Array, "b l"] | Rotation, theta: float,
         scaling: RopeScaling = NONE) -> Float[Array, "b l h d"]:
  """Rotary position embedding (rotate-half layout), computed in float32, at
  `positions` or by a `rotation` made for them."""
  rot = positions if isinstance(positions, Rotation) else rotation(positions, x.shape[-1], theta, scaling)
  if rot.cos.shape[-1] * 2 != x.shape[-1]:
    raise ValueError(f"a rotation for heads of {rot.cos.shape[-1] * 2} applied to heads of {x.shape[-1]}")
  cos, sin = rot.cos[:, :, None, :], rot.sin[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


__all__ = ["RopeScaling", "Rotation", "TYPES", "rope", "rotation"]
