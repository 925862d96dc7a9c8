"""KV-cached autoregressive decoding for the causal twin.

One jitted program per (sampler, shapes): a prefill forward over the
left-padded prompts, then a `lax.while_loop` that feeds one token per row
through the cache per step and stops as soon as every row has emitted EOS.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from mdlm_jax.model.kv_cache import KVCache
from mdlm_jax.sampling import rule
from mdlm_jax.sampling.gumbel import argmax, gumbel_argmax, random_words, top_p_filter

if TYPE_CHECKING:
  from mdlm_jax.model.spec import ModelSpec


def sample_token(logits: Float[Array, "b v"], key: PRNGKeyArray, *, temperature: float,
                 top_p: float, never: tuple[int, ...] = ()) -> Int[Array, "b"]:
  """Argmax when temperature == 0; else Gumbel-max over the top-p nucleus of
  softmax(logits / temperature), the noise in float64 on CPU (see `gumbel`).
  The nucleus always keeps the most likely token, so a tiny top_p is greedy.
  The ids in `never` are never sampled."""
  logits = logits.astype(jnp.float32)
  if never:
    logits = logits.at[:, list(never)].set(-jnp.inf)
  if temperature == 0:
    return argmax(logits)
  logits = logits / temperature
  if top_p < 1.0:
    logits = top_p_filter(logits, top_p)
  return gumbel_argmax(logits, random_words(key, logits.shape))


@dataclasses.dataclass(frozen=True)
class ARSampler:
  """Ancestral sampling from a causal model; hashable, so static under jit.

  max_new_tokens: tokens generated per row (exactly, unless EOS comes first);
  temperature: 0 = greedy; top_p: nucleus mass, 1.0 = off; never: ids never
  sampled (the markers a model reads but never writes,
  `tokenizer.never_generated`); presence_penalty, frequency_penalty,
  logit_bias: OpenAI's logit moves over the tokens generated so far, as the
  diffusion samplers apply them (`rule.penalize`).
  """

  max_new_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  never: tuple[int, ...] = ()
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: tuple[tuple[int, float], ...] = ()

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    object.__setattr__(self, "logit_bias", rule.bias_pairs(self.logit_bias))
    self._check_moves()

  def _check_moves(self, vocab_size: int | None = None) -> None:
    rule.check_moves(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     logit_bias=self.logit_bias, vocab_size=vocab_size)

  @property
  def moves_logits(self) -> bool:
    return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

  def generate(self, spec: "ModelSpec", params: Any, prompt_tokens: Int[Array, "b p"],
               prompt_valid: Bool[Array, "b p"], key: PRNGKeyArray, *, eos_id: int,
               pad_id: int) -> dict[str, Array]:
    """Continues left-padded prompts (every row needs >= 1 real token).

    An eos_id outside the vocabulary never stops a row. Returns tokens
    [b, max_new_tokens] int32: the generated tokens, then the
    EOS that stopped the row (if any), then pad_id; lengths [b]: generated
    tokens before EOS; num_forward_passes: the prefill plus one per decode
    step (the loop exits once every row is done).
    """
    if not spec.cfg.causal:
      raise ValueError("AR sampling needs a causal model (model.causal=True)")
    if spec.cfg.time_conditioning:
      raise ValueError("AR sampling needs a model without time conditioning")
    self._check_moves(spec.cfg.vocab_size)
    return _generate(self, spec.graphdef, params, jnp.asarray(prompt_tokens, jnp.int32),
                     jnp.asarray(prompt_valid, jnp.bool_), key, jnp.int32(eos_id), jnp.int32(pad_id))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _generate(sampler: ARSampler, graphdef, params, prompt, prompt_valid, key, eos_id, pad_id):
  model = nnx.merge(graphdef, params)
  b, p = prompt.shape
  n = sampler.max_new_tokens
  draw = functools.partial(sample_token, temperature=sampler.temperature, top_p=sampler.top_p,
                           never=sampler.never)

  def sample(logits, key, tokens, i):
    """Token i, after the logit moves over tokens[:, :i], what each row generated so far."""
    if sampler.moves_logits:
      ids, bias = rule.bias_arrays(sampler.logit_bias)
      counted = jnp.broadcast_to(jnp.arange(n) < i, tokens.shape)
      counts = rule.token_counts(tokens, counted, logits.shape[-1])
      logits = rule.penalize(logits[:, None], counts, sampler.presence_penalty, sampler.frequency_penalty,
                             ids[None], bias[None])[:, 0]
    return draw(logits, key)
  # Positions count real tokens only, so a row's result does not depend on its padding.
  positions = jnp.maximum(jnp.cumsum(prompt_valid, axis=1, dtype=jnp.int32) - 1, 0)
  num_real = jnp.sum(prompt_valid, axis=1, dtype=jnp.int32)
  # The last sampled token is never fed back: p + n - 1 slots suffice.
  cache = KVCache.init(model.cfg, b, p + n - 1)
  logits, cache = model.forward_cached(prompt, positions, cache, commit=True, valid_new=prompt_valid, last_only=True)

  def record(tokens, done, lengths, i, tok):
    """Stores token i: pad for rows already done; EOS ends a row without counting."""
    tokens = tokens.at[:, i].set(jnp.where(done, pad_id, tok))
    is_eos = jnp.logical_and(tok == eos_id, jnp.logical_not(done))
    lengths = lengths + jnp.logical_not(jnp.logical_or(done, is_eos)).astype(jnp.int32)
    return tokens, jnp.logical_or(done, is_eos), lengths

  tokens = jnp.full((b, n), pad_id, jnp.int32)
  tok = sample(logits[:, -1], jax.random.fold_in(key, 0), tokens, 0)  # left padding: the last column is real
  tokens, done, lengths = record(tokens, jnp.zeros((b,), jnp.bool_), jnp.zeros((b,), jnp.int32), 0, tok)

  def cond(s):
    i, _, _, done, _, _ = s
    return jnp.logical_and(i < n, jnp.logical_not(jnp.all(done)))

  def body(s):
    i, cache, tokens, done, lengths, tok = s
    logits, cache = model.forward_cached(tok[:, None], (num_real + i - 1)[:, None], cache, commit=True)
    tok = sample(logits[:, 0], jax.random.fold_in(key, i), tokens, i)
    tokens, done, lengths = record(tokens, done, lengths, i, tok)
    return i + 1, cache, tokens, done, lengths, tok

  i, _, tokens, _, lengths, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, tokens, done, lengths, tok))
  return {"tokens": tokens, "lengths": lengths, "num_forward_passes": i}
