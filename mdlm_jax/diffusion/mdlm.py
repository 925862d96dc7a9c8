"""Masked diffusion (MDLM): schedules, forward masking, SUBS, the NELBO.

Pure functions of arrays. Conventions: t in [0, 1]; alpha(t) is the
probability that a token is still clean at time t, alpha(0) = 1 and
alpha(1) = eps; the continuous-time NELBO per sequence is

    E_t [ w(t) * sum_{l : x_t^l = [MASK]} -log p_theta(x_0^l | x_t) ],
    w(t) = -alpha'(t) / (1 - alpha(t))            (= 1/t for log-linear).

With the SUBS parameterisation the [MASK] logit is never predicted and
unmasked tokens are carried over, so only masked positions contribute.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mdlm_jax.kernels.numerics import NEG_INF



@dataclasses.dataclass(frozen=True)
class Schedule:
  """alpha(t) and the NELBO weight. Frozen and hashable: static under jit.

  loglinear: alpha = 1 - (1 - eps) t            (MDLM's default)
  linear:    alpha = eps ** t                   (total noise sigma linear in t)
  cosine:    alpha = eps + (1 - eps) cos(pi t / 2)
  """

  kind: str = "loglinear"
  eps: float = 1e-3

  def __post_init__(self):
    if self.kind not in ("loglinear", "linear", "cosine"):
      raise ValueError(f"unknown schedule {self.kind!r}")
    if not 0 < self.eps < 1:
      raise ValueError(f"schedule eps must be in (0, 1), got {self.eps}")

  def alpha(self, t):
    e = self.eps
    if self.kind == "loglinear":
      return 1.0 - (1.0 - e) * t
    if self.kind == "linear":
      return jnp.exp(t * math.log(e))
    return e + (1.0 - e) * jnp.cos(0.5 * jnp.pi * t)

  def time_of(self, alpha):
    """The t at which the schedule reaches `alpha` (the inverse of `alpha`),
    clipped to [0, 1]."""
    e = self.eps
    alpha = jnp.clip(alpha, e, 1.0)
    if self.kind == "loglinear":
      t = (1.0 - alpha) / (1.0 - e)
    elif self.kind == "linear":
      t = jnp.log(alpha) / math.log(e)
    else:
      t = jnp.arccos(jnp.clip((alpha - e) / (1.0 - e), -1.0, 1.0)) / (0.5 * jnp.pi)
    return jnp.clip(t, 0.0, 1.0)

  def dalpha(self, t):
    e = self.eps
    if self.kind == "loglinear":
      return -(1.0 - e) * jnp.ones_like(t)
    if self.kind == "linear":
      return math.log(e) * jnp.exp(t * math.log(e))
    return -(1.0 - e) * 0.5 * jnp.pi * jnp.sin(0.5 * jnp.pi * t)

  def weight(self, t):
    """-alpha'(t) / (1 - alpha(t)), positive for t in (0, 1].

    1 - alpha(t) is written without cancellation so that the weight stays
    accurate in float32 near t = sampling_eps, where it is largest."""
    e = self.eps
    if self.kind == "loglinear":
      return 1.0 / t
    if self.kind == "linear":
      return -math.log(e) * jnp.exp(t * math.log(e)) / -jnp.expm1(t * math.log(e))
    one_minus_alpha = (1.0 - e) * 2.0 * jnp.sin(0.25 * jnp.pi * t) ** 2
    return -self.dalpha(t) / one_minus_alpha


def sample_times(key: jax.Array, batch: int, *, antithetic: bool = True,
                 sampling_eps: float = 1e-3, t_max: float = 1.0) -> Float[Array, "b"]:
  """t ~ U[sampling_eps, t_max]; antithetic draws one stratum per batch element,
  which lowers the variance of the batch NELBO without biasing it. t_max < 1
  (with a raised sampling_eps) is BD3-LM's clipped schedule for training."""
  u = jax.random.uniform(key, (batch,), dtype=jnp.float32)
  if antithetic:
    # (i + u) / B, kept below 1 so float rounding never wraps a draw to t = 0.
    u = jnp.minimum((jnp.arange(batch, dtype=jnp.float32) + u) / batch, 1.0 - 2.0 ** -24)
  return (t_max - sampling_eps) * u + sampling_eps


def forward_mask(key: jax.Array, x0: Int[Array, "b l"], t: Float[Array, "b"], schedule: Schedule,
                 mask_id: int) -> tuple[Int[Array, "b l"], Bool[Array, "b l"]]:
  """Samples x_t ~ q(x_t | x_0): each token independently becomes [MASK]
  with probability 1 - alpha(t). Returns (x_t, is_masked)."""
  p_mask = 1.0 - schedule.alpha(t)
  masked = jax.random.uniform(key, x0.shape) < p_mask[:, None]
  return jnp.where(masked, mask_id, x0), masked


def subs_log_probs(logits: Float[Array, "b l v"], xt: Int[Array, "b l"], mask_id: int) -> Float[Array, "b l v"]:
  """SUBS parameterisation of log p_theta(x_0 | x_t).

  Zero masking: the [MASK] class gets probability 0. Carry-over: at unmasked
  positions all mass sits on the observed token. Materialises [b, l, v]; the
  loss below avoids that and is used for training.
  """
  logits = logits.astype(jnp.float32)
  logits = logits.at[..., mask_id].set(NEG_INF)
  logp = jax.nn.log_softmax(logits, axis=-1)
  carry = jnp.where(jax.nn.one_hot(xt, logits.shape[-1], dtype=bool), 0.0, NEG_INF)
  return jnp.where((xt == mask_id)[..., None], logp, carry)


def masked_token_nll(logits: Float[Array, "b l v"], x0: Int[Array, "b l"], mask_id: int) -> Float[Array, "b l"]:
  """-log p_theta(x_0 | x_t) under zero masking of the [MASK] logit, without
  building a [b, l, v] log-softmax."""
  logits = logits.astype(jnp.float32)
  logits = logits.at[..., mask_id].set(NEG_INF)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target = jnp.take_along_axis(logits, x0[..., None], axis=-1)[..., 0]
  return lse - target


def nelbo_per_token(logits: Float[Array, "b l v"], x0: Int[Array, "b l"], masked: Bool[Array, "b l"],
                    t: Float[Array, "b"], schedule: Schedule, mask_id: int) -> Float[Array, "b l"]:
  """Per-position NELBO contributions in nats: w(t) * -log p(x_0) where masked,
  exactly 0 where the token was carried over."""
  nll = masked_token_nll(logits, x0, mask_id)
  return jnp.where(masked, schedule.weight(t)[:, None] * nll, 0.0)


def ar_nll(logits: Float[Array, "b l v"], tokens: Int[Array, "b l"]) -> Float[Array, "b l-1"]:
  """Next-token negative log-likelihood: position i predicts token i + 1."""
  logits = logits[:, :-1].astype(jnp.float32)
  targets = tokens[:, 1:]
  lse = jax.nn.logsumexp(logits, axis=-1)
  return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


LN2 = math.log(2.0)


def summarize(nats_per_token) -> dict[str, float]:
  """NELBO (or NLL) in nats and bits per token, and the perplexity (bound)."""
  nats = float(nats_per_token)
  return {"nats_per_token": nats, "bits_per_token": nats / LN2, "ppl": math.exp(min(nats, 700.0))}
