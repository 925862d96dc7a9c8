"""Training objectives as frozen (jit-static) callables on (model, tokens, key).

Both return sums, not means, so that gradient accumulation and evaluation can
combine micro-batches exactly: (sum of per-token losses, number of tokens).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mdlm_jax import diffusion


@dataclasses.dataclass(frozen=True)
class MDLMObjective:
  schedule: diffusion.Schedule
  mask_id: int
  time_conditioning: bool = False
  antithetic: bool = True
  sampling_eps: float = 1e-3

  def __call__(self, model, tokens, key, t=None):
    """NELBO sum over the batch in nats, and the token count. `t` overrides
    the sampled times (evaluation uses a fixed, seeded set)."""
    k_t, k_mask = jax.random.split(key)
    if t is None:
      t = diffusion.sample_times(k_t, tokens.shape[0], antithetic=self.antithetic,
                                 sampling_eps=self.sampling_eps)
    xt, masked = diffusion.forward_mask(k_mask, tokens, t, self.schedule, self.mask_id)
    logits = model(xt, t if self.time_conditioning else None)
    per_token = diffusion.nelbo_per_token(logits, tokens, masked, t, self.schedule, self.mask_id)
    return per_token.sum(), jnp.asarray(tokens.size, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ARObjective:
  def __call__(self, model, tokens, key=None, t=None):
    del key, t
    nll = diffusion.ar_nll(model(tokens), tokens)
    return nll.sum(), jnp.asarray(nll.size, jnp.float32)


def from_config(config, mask_id: int):
  if config.objective == "ar":
    return ARObjective()
  d = config.diffusion
  return MDLMObjective(
      schedule=diffusion.Schedule(d.schedule, d.eps), mask_id=int(mask_id),
      time_conditioning=bool(config.model.time_conditioning), antithetic=bool(d.antithetic),
      sampling_eps=float(d.sampling_eps))
