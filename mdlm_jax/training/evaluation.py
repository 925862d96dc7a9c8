"""Likelihood, the one place: the NELBO bound for diffusion models, exact NLL
for the AR twin, each from the model's own objective. `evaluate` averages it
over batches of packed rows; `Scorer` gives it per row of a list of token
rows (ranking infills, scoring completions given their prompts).
"""

from __future__ import annotations

from typing import Sequence

import math

import jax
import jax.numpy as jnp
import numpy as np

from mdlm_jax import diffusion
from mdlm_jax.parallel import sharding
from mdlm_jax.model.spec import ModelSpec, bind
from mdlm_jax.diffusion import objectives
from mdlm_jax.diffusion.objectives import MDLMObjective


def make_eval_step(spec: ModelSpec, objective):
  @jax.jit
  def step(params, batch, key):
    if isinstance(batch, dict):  # instruction tuning: the response only
      return objective(bind(spec, params), batch["tokens"], key, loss_mask=batch["loss_mask"])
    return objective(bind(spec, params), batch, key)
  return step


def evaluate(spec: ModelSpec, objective, params, batches: Sequence[np.ndarray], *, time_samples: int = 1,
             seed: int = 0, mesh=None, step_fn=None) -> dict:
  """Averages over batches (and, for MDLM, over `time_samples` seeded draws of
  t and the mask per sequence). The same seed gives the same number."""
  step_fn = step_fn or make_eval_step(spec, objective)
  samples = time_samples if isinstance(objective, MDLMObjective) else 1
  base = jax.random.PRNGKey(seed)
  total, count = 0.0, 0.0
  for i, batch in enumerate(batches):
    tokens = jax.tree.map(lambda x: jnp.asarray(x) if mesh is None else sharding.global_batch(np.asarray(x), mesh),
                          batch)
    for j in range(samples):
      s, n = step_fn(params, tokens, jax.random.fold_in(jax.random.fold_in(base, i), j))
      total += float(s)
      count += float(n)
  if count == 0:
    raise ValueError("evaluation got no tokens")
  out = diffusion.summarize(total / count)
  out.update({
      "tokens": int(count / samples), "batches": len(batches),
      "time_samples": samples,
      "bound": isinstance(objective, MDLMObjective),
  })
  return out


def describe(result: dict) -> str:
  what = "NELBO" if result["bound"] else "NLL"
  ppl = "PPL <=" if result["bound"] else "PPL"
  return (f"{what} {result['nats_per_token']:.4f} nats/token = {result['bits_per_token']:.4f} bits/token,"
          f" {ppl} {result['ppl']:.3f} over {result['tokens']} tokens")


class Scorer:
  """Per-row negative log-likelihood of token rows under a model's objective.

  Rows of any lengths share one padded batch; padding is never attended to
  and never scored, so a row scores the same alone or beside others. For a
  diffusion model the bound is averaged over `time_samples` fixed strata of
  t, u = (j + 0.5) / time_samples, the same for every row (and block), and
  seeded masks, the same for every row (common random numbers): comparable
  across rows and calls."""

  def __init__(self, spec: ModelSpec, objective, params, *, time_samples: int = 16, seed: int = 0):
    if time_samples < 1:
      raise ValueError(f"time_samples must be >= 1, got {time_samples}")
    self.spec, self.objective, self.params, self.seed = spec, objective, params, seed
    self.time_samples = time_samples if isinstance(objective, MDLMObjective) else 1
    multiple = math.lcm(64, getattr(objective, "block_size", 1))

    @jax.jit
    def row_sums(params, tokens, valid, weights, key, t):
      model = bind(spec, params)

      def one(tokens, valid, weights, t):
        # One row at a time under one key: a row's masks depend on neither its
        # index nor the batch's width (partitionable threefry draws by column).
        if t is None:
          return jnp.sum(objective.per_token(model, tokens[None], key, None, valid[None])[0] * weights)
        # Diffusion: only scored tokens are ever masked; the context stays in view.
        per = objective.per_token(model, tokens[None], key, t[None], valid[None], loss_mask=(weights > 0)[None])
        return jnp.sum(per[0] * weights)

      return jax.vmap(one)(tokens, valid, weights, t)

    self._row_sums, self._multiple = row_sums, multiple

  @classmethod
  def for_model(cls, loaded, **kw) -> "Scorer":
    """The scorer of a loaded checkpoint, under the objective it was trained with."""
    objective = objectives.from_config(loaded.config, loaded.tokenizer.mask_id)
    return cls(loaded.spec, objective, loaded.params, **kw)

  def __call__(self, rows: Sequence[Sequence[int]], context: Sequence[int] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(NLL in nats, tokens scored) of each row. `context[i]`: row i's first
    tokens that condition the rest but are not scored (a prompt); a
    diffusion model sees them unmasked, so its bound is on log p(rest | context)."""
    if not rows or min(len(r) for r in rows) == 0:
      raise ValueError("every row to score needs at least one token")
    context = [0] * len(rows) if context is None else list(context)
    if len(context) != len(rows):
      raise ValueError(f"{len(context)} context lengths for {len(rows)} rows")
    width = -(-max(len(r) for r in rows) // self._multiple) * self._multiple
    tokens = np.zeros((len(rows), width), np.int32)
    valid = np.zeros((len(rows), width), bool)
    weights = np.zeros((len(rows), width), np.float32)
    for i, r in enumerate(rows):
      tokens[i, :len(r)], valid[i, :len(r)] = r, True
      weights[i, max(context[i], self.objective.context_tokens):len(r)] = 1.0
    base = jax.random.PRNGKey(self.seed)
    total = np.zeros(len(rows))
    for j in range(self.time_samples):
      t = self.objective.fixed_times(len(rows), width, (j + 0.5) / self.time_samples)
      total += np.asarray(self._row_sums(self.params, tokens, valid, weights, jax.random.fold_in(base, j), t),
                          np.float64)
    return total / self.time_samples, weights.sum(-1).astype(np.int64)


def bound_profile(spec: ModelSpec, objective, params, batches: Sequence[np.ndarray], *, time_samples: int = 8,
                  seed: int = 0) -> dict:
  """Where a diffusion bound is lost: its integrand at the stratum midpoints
  t_j = (j + 0.5) / time_samples, per token, and for block diffusion per
  position in the block. Under the log-linear schedule the integrand at t is
  the mean cross-entropy of the tokens masked at that noise level, so a model
  that reads its block's visible tokens well has a flat profile; the mean
  over t is the stratified NELBO (`nats_per_token`). Batch i at stratum j
  draws its masks from key fold_in(fold_in(PRNGKey(seed), i), j)."""
  if not isinstance(objective, MDLMObjective):
    raise ValueError("a bound profile needs a diffusion checkpoint (an AR checkpoint's NLL is exact)")
  if time_samples < 1:
    raise ValueError(f"time_samples must be >= 1, got {time_samples}")
  block = getattr(objective, "block_size", 1)

  @jax.jit
  def per_token(params, tokens, key, t):
    return objective.per_token(bind(spec, params), tokens, key, t)

  ts = [(j + 0.5) / time_samples for j in range(time_samples)]
  by_t = np.zeros(time_samples)
  by_position = np.zeros((time_samples, block))
  count = 0
  base = jax.random.PRNGKey(seed)
  for i, batch in enumerate(batches):
    tokens = jnp.asarray(batch)
    b, l = tokens.shape
    if l % block:
      raise ValueError(f"rows of {l} tokens are not whole blocks of {block}")
    for j, t in enumerate(ts):
      key = jax.random.fold_in(jax.random.fold_in(base, i), j)
      per = np.asarray(per_token(params, tokens, key, objective.fixed_times(b, l, t)), np.float64)
      by_t[j] += per.sum()
      by_position[j] += per.reshape(b, l // block, block).sum((0, 1))
    count += tokens.size
  if count == 0:
    raise ValueError("a bound profile got no tokens")
  out = {"t": ts, "by_t": (by_t / count).tolist(), "nats_per_token": float(by_t.sum() / count / time_samples),
         "tokens": count}
  if block > 1:
    out["by_t_and_block_position"] = (by_position / (count / block)).tolist()
  return out


def describe_profile(profile: dict) -> str:
  """The profile as a table: one row per t, the block positions across."""
  positions = profile.get("by_t_and_block_position")
  head = "t      integrand" + ("   by block position 0.." + str(len(positions[0]) - 1) if positions else "")
  lines = [head]
  for j, t in enumerate(profile["t"]):
    row = f"{t:<6.3f} {profile['by_t'][j]:9.3f}"
    if positions:
      row += "   " + " ".join(f"{v:6.2f}" for v in positions[j])
    lines.append(row)
  lines.append(f"mean   {profile['nats_per_token']:9.3f}  (the stratified NELBO, nats/token)")
  return "\n".join(lines)
