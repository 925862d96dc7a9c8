"""Block diffusion (BD3-LM, Arriola et al. 2025): masked diffusion within
blocks, autoregression across them.

The sequence of length L is cut into L / L' blocks of L' tokens. Block b is
noised at its own time t_b and denoised given the clean blocks before it, so

    -log p(x) <= sum_b E_{t_b} [ w(t_b) sum_{l in b, x_t^l = [MASK]} -log p(x^l | x_t^b, x^{<b}) ].

All blocks train in one forward pass over [x_t ; x_0] (length 2L), with an
attention mask that lets noisy block b see itself and the clean blocks < b,
and the clean half see itself block-causally (it supplies the context keys
that a sampler would keep in its KV cache). RoPE positions repeat, so clean
token i sits at the same position as noisy token i. With L' = L this is
MDLM exactly: the noisy half never sees the clean half.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from mdlm_jax import diffusion, kernels


def count_blocks(seq_len: int, block_size: int) -> int:
  if block_size <= 0 or seq_len % block_size:
    raise ValueError(f"block_size={block_size} must be positive and divide seq_len={seq_len}")
  return seq_len // block_size


def block_attention_mask(seq_len: int, block_size: int, clean_causal: bool = False) -> np.ndarray:
  """bool [2L, 2L], True = attend; rows and columns are [x_t ; x_0]. With
  `clean_causal` the clean half is token-causal: the context an AR model
  adapted to diffusion computes exactly as it did (model.clean_causal).

  A numpy constant of static shape, so under jit it is folded into the
  program instead of being rebuilt each step."""
  count_blocks(seq_len, block_size)
  blk = np.arange(seq_len) // block_size
  q, k = blk[:, None], blk[None, :]
  noisy_to_noisy = q == k  # block-diagonal: denoise a block jointly
  noisy_to_clean = k < q  # offset block-causal: the clean context before it
  clean_to_noisy = np.zeros((seq_len, seq_len), bool)  # clean keys never see noise
  # block-causal, as a sampler's KV cache would be built; or token-causal
  clean_to_clean = np.arange(seq_len)[None] <= np.arange(seq_len)[:, None] if clean_causal else k <= q
  return np.block([[noisy_to_noisy, noisy_to_clean], [clean_to_noisy, clean_to_clean]])


def block_positions(seq_len: int) -> np.ndarray:
  """int32 [2L] RoPE positions: [0..L-1, 0..L-1]."""
  return np.tile(np.arange(seq_len, dtype=np.int32), 2)


def sample_block_times(key: jax.Array, batch: int, num_blocks: int, antithetic: bool = True,
                       sampling_eps: float = 1e-3, t_max: float = 1.0) -> Float[Array, "b n"]:
  """Per-block t ~ U[sampling_eps, t_max], [batch, num_blocks].

  Antithetic: the batch * num_blocks draws take one stratum each, assigned to
  blocks by a random permutation. Blocks at different positions are not
  exchangeable (block 0 has no context), so a fixed row-major map would give
  block j only strata j, n + j, ... and bias each block's term; a random map
  keeps every t_b marginally uniform. With one block per row the rows are
  exchangeable and the fixed map of `diffusion.sample_times` is kept, so
  block_size == seq_len draws exactly MDLM's times."""
  if num_blocks == 1:
    return diffusion.sample_times(key, batch, antithetic=antithetic, sampling_eps=sampling_eps, t_max=t_max)[:, None]
  n = batch * num_blocks
  u = jax.random.uniform(key, (n,), dtype=jnp.float32)
  if antithetic:
    strata = jax.random.permutation(jax.random.fold_in(key, 1), n).astype(jnp.float32)
    u = jnp.minimum((strata + u) / n, 1.0 - 2.0 ** -24)
  return ((t_max - sampling_eps) * u + sampling_eps).reshape(batch, num_blocks)


def position_scales(block_size: int, slope: float) -> np.ndarray:
  """Each position's factor on its block's time (position-dependent masking):
  1 - slope at a block's first token rising evenly to 1 + slope at its last,
  so the left of a block is in view more often, as it is when a block is
  decoded left to right; all 1 with slope 0."""
  if block_size == 1 or not slope:
    return np.ones((block_size,), np.float32)
  return (1.0 + slope * (2.0 * np.arange(block_size) / (block_size - 1) - 1.0)).astype(np.float32)


def token_times(t: Float[Array, "b n"], length: int, slope: float = 0.0) -> Float[Array, "b l"]:
  """Each token's time: its block's, scaled by `position_scales`, at most 1."""
  n = t.shape[1]
  scales = jnp.tile(jnp.asarray(position_scales(length // n, slope)), n)
  return jnp.minimum(jnp.repeat(t, length // n, axis=1, total_repeat_length=length) * scales, 1.0)


def block_forward_mask(key: jax.Array, x0: Int[Array, "b l"], t: Float[Array, "b n"],
                       schedule: diffusion.Schedule, mask_id: int,
                       slope: float = 0.0) -> tuple[Int[Array, "b l"], Bool[Array, "b l"]]:
  """x_t ~ q(x_t | x_0) with block b's tokens masked w.p. 1 - alpha(t_b), or
  with `slope` w.p. 1 - alpha of each token's own time (`token_times`).

  The same uniform draws as `diffusion.forward_mask` for the same key, so one
  block reproduces MDLM's masks."""
  p_mask = 1.0 - schedule.alpha(token_times(t, x0.shape[1], slope))
  masked = jax.random.uniform(key, x0.shape) < p_mask
  return jnp.where(masked, mask_id, x0), masked


def token_weights(t: Float[Array, "b n"], length: int, schedule: diffusion.Schedule,
                  slope: float = 0.0) -> Float[Array, "b l"]:
  """Each token's NELBO weight at its block's time t: a token whose time is
  c t follows the schedule alpha(c t), whose weight is c w(c t), and 0 once
  c t reaches 1 (it stays masked from there, and adds nothing)."""
  n = t.shape[1]
  scales = jnp.tile(jnp.asarray(position_scales(length // n, slope)), n)
  own = jnp.repeat(t, length // n, axis=1, total_repeat_length=length) * scales
  return jnp.where(own < 1.0, scales * schedule.weight(jnp.minimum(own, 1.0)), 0.0)


def complementary_views(key: jax.Array, x0: Int[Array, "b l"], t: Float[Array, "b n"], schedule: diffusion.Schedule,
                        mask_id: int, loss_mask: Bool[Array, "b l"] | None = None):
  """Two views of each row whose masks are complements (LaViDa's
  complementary masking): the first is `block_forward_mask`'s draw at t, the
  second masks exactly the scorable tokens the first leaves in view, which
  is a draw of q(x_t' | x_0) at the t' where alpha(t') = 1 - alpha(t). Every
  scorable token is masked, and so trains the model, in one view of each
  pair. Returns (x_t [2b, l], masked [2b, l], t [2b, n]), the first views first."""
  _, first = block_forward_mask(key, x0, t, schedule, mask_id)
  scorable = jnp.ones_like(first) if loss_mask is None else loss_mask
  masked = jnp.concatenate([first & scorable, ~first & scorable], axis=0)
  tokens = jnp.concatenate([x0, x0], axis=0)
  times = jnp.concatenate([t, schedule.time_of(1.0 - schedule.alpha(t))], axis=0)
  return jnp.where(masked, mask_id, tokens), masked, times


def block_logits(model, xt: Int[Array, "b l"], x0: Int[Array, "b l"], block_size: int,
                 valid: Bool[Array, "b l"] | None = None, clean_grad: bool = False) -> Float[Array, "b l v"]:
  """Logits of the x_t half of one forward pass over [x_t ; x_0]; no token
  attends to padding (`valid` False) in either half. A model with
  `clean_causal` reads its clean half token-causally, and its adapters
  (model.lora_rank) act on the x_t half only (`clean_grad`: see
  `adapted_block_logits`)."""
  b, l = xt.shape
  tokens = jnp.concatenate([xt, x0], axis=1)
  positions = jnp.broadcast_to(jnp.asarray(block_positions(l)), (b, 2 * l))
  count_blocks(l, block_size)
  # Structural, so a kernel builds it per tile; equal to `block_attention_mask`.
  kv_valid = None if valid is None else jnp.concatenate([valid, valid], axis=1)
  if model.cfg.clean_causal and valid is None:
    return adapted_block_logits(model, xt, x0, block_size, clean_grad=clean_grad)
  kind = "block_diffusion_causal" if model.cfg.clean_causal else "block_diffusion"
  mask = kernels.AttentionMask(kind=kind, block_size=block_size, kv_valid=kv_valid)
  noisy = jnp.broadcast_to(jnp.arange(2 * l) < l, (b, 2 * l)) if model.cfg.lora_rank else None
  hidden = model.hidden_states(tokens, None, positions, mask, noisy=noisy)
  if not model.cfg.shift_logits:
    # Only the x_t half is scored: skip the vocabulary projection of the x_0 half.
    return model.logits(hidden[:, :l])
  return model.logits(shifted_noisy_states(hidden, block_size))


def adapted_block_logits(model, xt, x0, block_size: int, with_teacher: bool = False, clean_grad: bool = False):
  """`block_logits` of an adapted AR model (model.clean_causal) in two passes: the
  clean stream alone, causal and without adapters, under stop_gradient (so no
  backward runs through it), its keys and values kept as a KV cache; then the
  noisy stream over that cache, block b reading clean blocks < b and itself.
  The same numbers as the one [x_t ; x_0] pass, at about three quarters of its
  training cost. Without adapters-only training the base's weights learn too,
  and the clean stream shapes the loss through its keys and values:
  `clean_grad` keeps its gradient (the joint pass's gradients, tested).

  `with_teacher` also returns the clean stream's own next-token logits
  (state i - 1 scores token i; row 0 scores nothing and is a copy of row 1):
  p(x_i | x_<i) of the AR model the clean stream computes, which with frozen
  weights and adapters gated to the noisy stream is the base itself. They are
  the soft targets of distillation and the AR loss's predictions, and come at
  the cost of one extra vocabulary projection (with a gradient only under
  `clean_grad`)."""
  from mdlm_jax.model.kv_cache import KVCache
  b, l = xt.shape
  count_blocks(l, block_size)
  positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  cache = KVCache.init(model.cfg, b, 2 * l)
  valid, causal = cache.attention_spec(jnp.ones((b, l), jnp.bool_), causal=True)
  clean_states, written = model._trunk(x0, None, positions, causal=False, mask=causal, cache=cache,  # pylint: disable=protected-access
                                       noisy=False)
  cache = written.commit(cache.kept_valid(valid, l), l)
  if not clean_grad:
    cache, clean_states = jax.lax.stop_gradient((cache, clean_states))
  blk = np.arange(l) // block_size
  reads = np.concatenate([blk[None, :] < blk[:, None], blk[None, :] == blk[:, None]], axis=1)  # [l, 2l]
  noisy = jnp.ones((b, l), jnp.bool_) if model.cfg.lora_rank else None
  noisy_states, _ = model._trunk(xt, None, positions, causal=False, mask=jnp.asarray(reads)[None, None],  # pylint: disable=protected-access
                                 cache=cache, noisy=noisy)
  if not model.cfg.shift_logits:
    if with_teacher:
      raise ValueError("distillation reads the clean stream's next-token logits: it needs model.shift_logits")
    return model.logits(noisy_states)
  logits = model.logits(shifted_noisy_states(jnp.concatenate([noisy_states, clean_states], axis=1), block_size))
  if not with_teacher:
    return logits
  teacher = model.logits(jnp.concatenate([clean_states[:, :1], clean_states[:, :-1]], axis=1))
  return logits, teacher


def shifted_noisy_states(hidden: Float[Array, "b l2 d"], block_size: int) -> Float[Array, "b l d"]:
  """The states a shifted head scores noisy token i from: noisy i - 1 inside a
  block; at a block's first token, clean i - 1 (the end of the context, which
  a KV-cached sampler holds as the cache's last state); token 0 its own."""
  l = hidden.shape[1] // 2
  noisy, clean = hidden[:, :l], hidden[:, l:]
  prev_noisy = jnp.concatenate([noisy[:, :1], noisy[:, :-1]], axis=1)
  prev_clean = jnp.concatenate([noisy[:, :1], clean[:, :-1]], axis=1)
  starts = (np.arange(l) % block_size == 0)[None, :, None]
  return jnp.where(starts, prev_clean, prev_noisy)


def soft_target_kl(logits: Float[Array, "b l v"], teacher: Float[Array, "b l v"], mask_id: int) -> Float[Array, "b l"]:
  """KL(teacher || student) per position in nats, both without [MASK] (as the
  NELBO zeroes it; an AR vocabulary's borrowed mask token may carry teacher
  mass), from logits in float32.

  Its gradient is the soft-target cross-entropy's; unlike the cross-entropy
  it is 0 when the student matches, so it can be logged as a distance."""
  log_q = jax.nn.log_softmax(logits.astype(jnp.float32).at[..., mask_id].set(diffusion.NEG_INF), axis=-1)
  log_p = jax.nn.log_softmax(teacher.astype(jnp.float32).at[..., mask_id].set(diffusion.NEG_INF), axis=-1)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def block_nelbo_per_token(logits: Float[Array, "b l v"], x0: Int[Array, "b l"], masked: Bool[Array, "b l"],
                          t: Float[Array, "b n"], schedule: diffusion.Schedule, mask_id: int,
                          slope: float = 0.0) -> Float[Array, "b l"]:
  """w(t_b) * -log p(x_0) at masked positions of block b, 0 elsewhere (with
  `slope`, each token's own weight: `token_weights`).

  Each block is the MDLM NELBO of a length-L' sequence at its own time, so
  the blocks are folded into the batch and `diffusion.nelbo_per_token` used
  as is."""
  if slope:
    weight = token_weights(t, x0.shape[1], schedule, slope)
    return jnp.where(masked, weight * diffusion.masked_token_nll(logits, x0, mask_id), 0.0)
  b, l, v = logits.shape
  n = t.shape[1]
  per = diffusion.nelbo_per_token(logits.reshape(b * n, l // n, v), x0.reshape(b * n, l // n),
                                  masked.reshape(b * n, l // n), t.reshape(b * n), schedule, mask_id)
  return per.reshape(b, l)
