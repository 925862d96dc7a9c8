"""Likelihood evaluation: the NELBO bound for MDLM, exact NLL for the AR twin."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mdlm_jax import diffusion
from mdlm_jax.parallel import sharding
from mdlm_jax.model.spec import ModelSpec, bind
from mdlm_jax.diffusion.objectives import MDLMObjective


def make_eval_step(spec: ModelSpec, objective):
  @jax.jit
  def step(params, tokens, key):
    return objective(bind(spec, params), tokens, key)
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
    batch = np.asarray(batch, np.int32)
    tokens = jnp.asarray(batch) if mesh is None else sharding.global_batch(batch, mesh)
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
