"""`evaluation.Scorer`: per-row likelihood under a model's own objective."""

import jax
import numpy as np
import pytest

from mdlm_jax import diffusion
from mdlm_jax.diffusion.objectives import ARObjective, BD3Objective, MDLMObjective
from mdlm_jax.model import ModelConfig
from mdlm_jax.model.spec import bind, init_params, model_spec
from mdlm_jax.training.evaluation import Scorer

V, MASK = 29, 28


def spec_and_params(causal: bool, seed: int):
  cfg = ModelConfig(vocab_size=V, num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32, causal=causal)
  spec = model_spec(cfg, None)
  return spec, init_params(spec, seed)


def test_ar_rows_match_a_float64_log_softmax():
  spec, params = spec_and_params(True, 1)
  rng = np.random.default_rng(1)
  rows = [rng.integers(0, MASK, n).tolist() for n in (5, 70, 12)]
  context = [2, 0, 11]
  nll, count = Scorer(spec, ARObjective(), params)(rows, context)
  # The reference: one forward of the rows padded at the end (a causal model's logits at a position do not
  # read what follows it), jitted: eager, the model's op-by-op dispatch took seconds a row.
  padded = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    padded[i, :len(row)] = row
  every = np.asarray(jax.jit(lambda p, x: bind(spec, p)(x))(params, padded), np.float64)
  for row, c, got, n, logits in zip(rows, context, nll, count, every):
    logits = logits[:len(row)]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    first = max(c, 1)  # nothing predicts token 0
    assert n == len(row) - first
    np.testing.assert_allclose(got, -sum(logp[i - 1, row[i]] for i in range(first, len(row))), rtol=2e-5)


OBJECTIVES = {
    "mdlm": MDLMObjective(schedule=diffusion.Schedule("loglinear"), mask_id=MASK),
    "bd3": BD3Objective(schedule=diffusion.Schedule("loglinear"), mask_id=MASK, block_size=8),
}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_diffusion_row_scores_alone_as_beside_a_longer_row(name):
  """Padding is neither attended to nor scored, and masks do not depend on
  the batch: a row's bound is the same alone and in a wider batch."""
  spec, params = spec_and_params(False, 2)
  scorer = Scorer(spec, OBJECTIVES[name], params, time_samples=3, seed=5)
  rng = np.random.default_rng(2)
  short, long = rng.integers(0, MASK, 21).tolist(), rng.integers(0, MASK, 100).tolist()
  alone, n_alone = scorer([short], [4])
  both, n_both = scorer([long, short], [0, 4])
  assert n_alone[0] == n_both[1] == 17 and n_both[0] == 100
  np.testing.assert_allclose(both[1], alone[0], rtol=1e-5)
  assert np.isfinite(both).all() and (both > 0).all()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "mdlm" else n
                                  for n in sorted(OBJECTIVES)])  # BD3 by default: the block objective's harder case
def test_diffusion_full_row_equals_the_objective_at_the_same_times(name):
  """A row that fills the batch width exactly is the objective's own sum at
  the scorer's strata and keys (the objective is tested against numpy)."""
  objective = OBJECTIVES[name]
  spec, params = spec_and_params(False, 3)
  samples, seed = 2, 9
  row = np.random.default_rng(3).integers(0, MASK, 64)
  got, count = Scorer(spec, objective, params, time_samples=samples, seed=seed)([row.tolist()])
  loss = jax.jit(lambda p, x, key, t: objective(bind(spec, p), x, key, t))  # eager, each call took seconds
  want = np.mean([float(loss(params, row[None].astype(np.int32), jax.random.fold_in(jax.random.PRNGKey(seed), j),
                             objective.fixed_times(1, 64, (j + 0.5) / samples))[0]) for j in range(samples)])
  assert count[0] == 64
  np.testing.assert_allclose(got[0], want, rtol=1e-5)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "mdlm" else n
                                  for n in sorted(OBJECTIVES)])  # BD3 by default: its mid-block case
def test_diffusion_context_stays_in_view(name):
  """With a context, the bound is on the rest given the context: the
  objective's sum with only the rest ever masked (its loss_mask, tested
  against numpy), not the whole row's terms restricted to the rest."""
  objective = OBJECTIVES[name]
  spec, params = spec_and_params(False, 4)
  row, c = np.random.default_rng(4).integers(0, MASK, 64), 20  # mid-block: BD3 reads earlier blocks clean anyway
  got, count = Scorer(spec, objective, params, time_samples=1, seed=3)([row.tolist()], [c])
  key, t = jax.random.fold_in(jax.random.PRNGKey(3), 0), objective.fixed_times(1, 64, 0.5)
  rest = (np.arange(64) >= c)[None]
  x = row[None].astype(np.int32)
  want = float(jax.jit(lambda p: objective(bind(spec, p), x, key, t, loss_mask=rest))(params)[0])
  assert count[0] == 64 - c
  np.testing.assert_allclose(got[0], want, rtol=1e-5)
  unconditional = float(np.sum(np.asarray(jax.jit(lambda p: objective.per_token(bind(spec, p), x, key, t))(params))
                               * rest))
  assert abs(got[0] - unconditional) > 1e-4 * abs(want)  # float32 noise is ~1e-6 of it


def test_bad_rows_are_refused():
  spec, params = spec_and_params(True, 0)
  scorer = Scorer(spec, ARObjective(), params)
  with pytest.raises(ValueError, match="at least one token"):
    scorer([[1, 2], []])
  with pytest.raises(ValueError, match="context lengths"):
    scorer([[1, 2]], [0, 1])
  with pytest.raises(ValueError, match="time_samples"):
    Scorer(spec, ARObjective(), params, time_samples=0)


@pytest.mark.slow  # 9 s
def test_bound_profile_is_the_integrand_at_each_noise_level_and_block_position():
  """Against float64 numpy: at each stratum t, (1/t) x the cross-entropy
  ([MASK] left out of the softmax) of the tokens the objective's key masks,
  per token and per position in the block; its mean is the stratified bound."""
  from mdlm_jax.diffusion import bd3
  from mdlm_jax.training.evaluation import bound_profile
  objective = OBJECTIVES["bd3"]
  spec, params = spec_and_params(False, 4)
  rng = np.random.default_rng()
  batches = [rng.integers(0, MASK, (2, 32)).astype(np.int32) for _ in range(2)]
  seed, samples = int(rng.integers(1 << 30)), 3
  got = bound_profile(spec, objective, params, batches, time_samples=samples, seed=seed)
  model = bind(spec, params)
  by_t, by_pos = np.zeros(samples), np.zeros((samples, 8))
  for i, x0 in enumerate(batches):
    for j in range(samples):
      t = (j + 0.5) / samples
      key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), i), j)
      _, k_mask = jax.random.split(key)
      xt, masked = bd3.block_forward_mask(k_mask, x0, np.full((2, 4), t, np.float32), objective.schedule, MASK)
      logits = np.asarray(bd3.block_logits(model, xt, x0, 8), np.float64)
      logits[..., MASK] = -np.inf
      m = logits.max(-1, keepdims=True)
      logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
      term = np.where(np.asarray(masked), -np.take_along_axis(logp, x0[..., None], -1)[..., 0] / t, 0.0)
      by_t[j] += term.sum()
      by_pos[j] += term.reshape(2, 4, 8).sum((0, 1))
  n = sum(b.size for b in batches)
  np.testing.assert_allclose(got["by_t"], by_t / n, rtol=1e-4)
  np.testing.assert_allclose(got["by_t_and_block_position"], by_pos / (n / 8), rtol=1e-4)
  np.testing.assert_allclose(got["nats_per_token"], np.mean(by_t / n), rtol=1e-4)
  assert got["t"] == [1 / 6, 0.5, 5 / 6] and got["tokens"] == n
  with pytest.raises(ValueError, match="needs a diffusion checkpoint"):
    bound_profile(spec, ARObjective(), params, batches)
