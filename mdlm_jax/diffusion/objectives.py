"""Training objectives as frozen (jit-static) callables on (model, tokens, key).

Both return sums, not means, so that gradient accumulation and evaluation can
combine micro-batches exactly: (sum of per-token losses, number of tokens).
`per_token` gives the terms themselves, for scoring rows one by one
(`training.evaluation.Scorer`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mdlm_jax import diffusion, kernels
from mdlm_jax.diffusion import bd3


@dataclasses.dataclass(frozen=True)
class MDLMObjective:
  schedule: diffusion.Schedule
  mask_id: int
  time_conditioning: bool = False
  antithetic: bool = True
  sampling_eps: float = 1e-3
  t_max: float = 1.0  # < 1 only in training (BD3-LM's clipped schedule); evaluation draws up to 1.

  context_tokens = 0  # leading tokens of a row that are never scored

  def __call__(self, model, tokens, key, t=None, loss_mask=None):
    """NELBO sum over the batch in nats, and the token count. `t` overrides
    the sampled times (evaluation uses a fixed, seeded set). `loss_mask`
    [b, l] (instruction tuning): only those tokens are ever masked and
    scored, the rest (the prompt) stay in view, and the count is theirs."""
    per = self.per_token(model, tokens, key, t, loss_mask=loss_mask)
    return per.sum(), _count(tokens, loss_mask)

  def per_token(self, model, tokens, key, t=None, valid=None, loss_mask=None) -> jax.Array:
    """Each token's NELBO term in nats [b, l]. `valid` [b, l]: padding the
    model never attends to (its terms are still there, for the caller to drop)."""
    k_t, k_mask = jax.random.split(key)
    if t is None:
      t = diffusion.sample_times(k_t, tokens.shape[0], antithetic=self.antithetic,
                                 sampling_eps=self.sampling_eps, t_max=self.t_max)
    xt, masked = _only(diffusion.forward_mask(k_mask, tokens, t, self.schedule, self.mask_id), tokens, loss_mask,
                       self.mask_id)
    cond = t if self.time_conditioning else None
    logits = model(xt, cond) if valid is None else model(xt, cond, None, kernels.AttentionMask(kv_valid=valid))
    return diffusion.nelbo_per_token(logits, tokens, masked, t, self.schedule, self.mask_id)

  def fixed_times(self, batch: int, length: int, u: float) -> jax.Array:
    """Every row (and block) at the same time t = u: rows scored side by side
    are compared at equal noise levels."""
    return jnp.full((batch,), u, jnp.float32)


@dataclasses.dataclass(frozen=True)
class BD3Objective(MDLMObjective):
  """Block diffusion NELBO (BD3-LM): per-block times, one pass over [x_t ; x_0].

  A subclass of MDLMObjective because it is the same kind of quantity, a
  NELBO bound averaged over random times and masks: evaluation treats both
  alike (time_samples, `bound`). The model is never time-conditioned, since
  its conditioning takes one t per sequence.

  `distill_weight` lam > 0 (training an adapted AR model only): each masked
  token's term becomes w(t) * ((1 - lam) * -log p(x_0) + lam * KL(p_AR || p)),
  with p_AR the clean stream's own next-token distribution. Its expectation
  over the data is minimised by the AR model's marginal given what the block
  shows, as the NELBO's is by the data's, and each token supervises the
  whole vocabulary instead of one id: dense targets when tokens are few."""

  block_size: int = dataclasses.field(kw_only=True)
  distill_weight: float = dataclasses.field(default=0.0, kw_only=True)
  # Each row also seen with the complement of its masks (`bd3.complementary_views`),
  # its term the mean of the two views': every scorable token trains the model.
  complementary: bool = dataclasses.field(default=False, kw_only=True)
  # Position-dependent masking (`bd3.position_scales`): a block's tokens at times
  # (1 - slope) t to (1 + slope) t, left to right, each at its own NELBO weight.
  position_slope: float = dataclasses.field(default=0.0, kw_only=True)
  # An adapted AR model whose base weights train too (train.trainable="all"): the
  # clean stream keeps its gradient, and `ar_weight` adds its next-token loss
  # (the AR objective on the clean stream) to every scored token's term.
  frozen_base: bool = dataclasses.field(default=True, kw_only=True)
  ar_weight: float = dataclasses.field(default=0.0, kw_only=True)

  def __post_init__(self):
    if self.block_size <= 0:
      raise ValueError(f"block_size must be positive, got {self.block_size}")
    if self.time_conditioning:
      raise ValueError("block diffusion has one t per block; the model's conditioning takes one per sequence")
    if not 0.0 <= self.distill_weight <= 1.0:
      raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight}")
    if not 0.0 <= self.position_slope < 1.0:
      raise ValueError(f"position_slope must be in [0, 1), got {self.position_slope}")
    if self.ar_weight < 0 or (self.ar_weight and self.frozen_base):
      raise ValueError(f"ar_weight must be >= 0 and trains the base's own weights (frozen_base=False), got"
                       f" ar_weight={self.ar_weight}, frozen_base={self.frozen_base}")
    if self.position_slope and self.complementary:
      raise ValueError("complementary masks mirror a block's time; position-dependent masking gives each token"
                       " its own: use one of them")

  def per_token(self, model, tokens, key, t=None, valid=None, loss_mask=None) -> jax.Array:
    """Each token's NELBO term [b, l]; `t` [b, L / block_size] overrides the
    sampled per-block times."""
    b, l = tokens.shape
    n = bd3.count_blocks(l, self.block_size)
    k_t, k_mask = jax.random.split(key)
    if t is None:
      t = bd3.sample_block_times(k_t, b, n, antithetic=self.antithetic,
                                             sampling_eps=self.sampling_eps, t_max=self.t_max)
    if self.complementary:
      xt, masked, times = bd3.complementary_views(k_mask, tokens, t, self.schedule, self.mask_id, loss_mask)
      twice = lambda x: None if x is None else jnp.concatenate([x, x])  # noqa: E731
      both = self._terms(model, twice(tokens), xt, masked, times, twice(valid), twice(loss_mask))
      return 0.5 * (both[:b] + both[b:])
    xt, masked = _only(bd3.block_forward_mask(k_mask, tokens, t, self.schedule, self.mask_id, self.position_slope),
                       tokens, loss_mask, self.mask_id)
    return self._terms(model, tokens, xt, masked, t, valid, loss_mask)

  def _terms(self, model, tokens, xt, masked, t, valid, loss_mask=None):
    """Each token's term [b, l] given its row's noised view."""
    l = tokens.shape[1]
    if not (self.distill_weight or self.ar_weight):
      logits = bd3.block_logits(model, xt, tokens, self.block_size, valid, clean_grad=not self.frozen_base)
      return bd3.block_nelbo_per_token(logits, tokens, masked, t, self.schedule, self.mask_id, self.position_slope)
    if valid is not None or not model.cfg.clean_causal:
      raise ValueError("distillation and the AR loss train an adapted AR model (model.clean_causal) on full rows")
    logits, clean = bd3.adapted_block_logits(model, xt, tokens, self.block_size, with_teacher=True,
                                             clean_grad=not self.frozen_base)
    out = bd3.block_nelbo_per_token(logits, tokens, masked, t, self.schedule, self.mask_id, self.position_slope)
    first = (jnp.arange(l) > 0)[None, :]  # nothing predicts token 0
    if self.distill_weight:
      weight = bd3.token_weights(t, l, self.schedule, self.position_slope)
      kl = bd3.soft_target_kl(logits, jax.lax.stop_gradient(clean), self.mask_id)
      out = (1.0 - self.distill_weight) * out + self.distill_weight * jnp.where(masked & first, weight * kl, 0.0)
    if self.ar_weight:
      scored = first if loss_mask is None else first & loss_mask
      nll = jax.nn.logsumexp(clean.astype(jnp.float32), axis=-1) - jnp.take_along_axis(
          clean.astype(jnp.float32), tokens[..., None], axis=-1)[..., 0]
      out = out + self.ar_weight * jnp.where(scored, nll, 0.0)
    return out

  def fixed_times(self, batch: int, length: int, u: float) -> jax.Array:
    return jnp.full((batch, bd3.count_blocks(length, self.block_size)), u, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ARObjective:
  context_tokens = 1  # nothing predicts a row's first token

  def __call__(self, model, tokens, key=None, t=None, loss_mask=None):
    del key, t
    nll = diffusion.ar_nll(model(tokens), tokens)
    if loss_mask is None:
      return nll.sum(), jnp.asarray(nll.size, jnp.float32)
    scored = loss_mask[:, 1:]  # token i is scored from the tokens before it
    return jnp.sum(nll * scored), jnp.sum(scored).astype(jnp.float32)

  def per_token(self, model, tokens, key=None, t=None, valid=None) -> jax.Array:
    """-log p(x_i | x_<i) [b, l], 0 at i = 0. Causal attention never reads
    right padding, so `valid` changes nothing."""
    del key, t, valid
    return jnp.pad(diffusion.ar_nll(model(tokens), tokens), ((0, 0), (1, 0)))

  def fixed_times(self, batch: int, length: int, u: float) -> None:
    return None  # exact: no time to draw


def _only(xt_masked, tokens, loss_mask, mask_id: int):
  """(x_t, masked) with masking kept to `loss_mask` (None: everywhere)."""
  xt, masked = xt_masked
  if loss_mask is None:
    return xt, masked
  masked = masked & loss_mask
  return jnp.where(masked, mask_id, tokens), masked


def _count(tokens, loss_mask) -> jax.Array:
  return jnp.asarray(tokens.size if loss_mask is None else jnp.sum(loss_mask), jnp.float32)


def from_config(config, mask_id: int, training: bool = False):
  """The config's objective. With `training`, times are drawn from
  [diffusion.train_t_min, train_t_max]: BD3-LM's clipped mask rates, which
  cut the variance of the gradient (no t near 0, where the 1/t weight is
  large) at the price of a biased bound, so evaluation never uses them."""
  if config.objective == "ar":
    return ARObjective()
  d = config.diffusion
  lo, hi = float(d.sampling_eps), 1.0
  if training:
    lo, hi = max(lo, float(d.train_t_min)), float(d.train_t_max)
  block_size = int(d.block_size)
  if block_size > 0:
    return BD3Objective(
        schedule=diffusion.Schedule(d.schedule, d.eps), mask_id=int(mask_id), antithetic=bool(d.antithetic),
        sampling_eps=lo, t_max=hi, block_size=block_size,
        distill_weight=float(d.distill_weight) if training else 0.0,
        complementary=bool(d.complementary_masks) and training,
        position_slope=float(d.position_mask_slope) if training else 0.0,
        frozen_base=config.train.trainable == "adapters" or not training,
        ar_weight=float(d.ar_weight) if training else 0.0)
  return MDLMObjective(
      schedule=diffusion.Schedule(d.schedule, d.eps), mask_id=int(mask_id),
      time_conditioning=bool(config.model.time_conditioning), antithetic=bool(d.antithetic),
      sampling_eps=lo, t_max=hi)
