"""Masked diffusion maths (schedules, masking, SUBS, NELBO) against float64 numpy references."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import diffusion
from mdlm_jax.diffusion import objectives
from mdlm_jax.diffusion import Schedule

KINDS = ("loglinear", "linear", "cosine")
EPS = 1e-3

# ------------------------------------------------------------- references


def np_alpha(kind: str, t, eps: float = EPS):
  t = np.asarray(t, np.float64)
  if kind == "loglinear":
    return 1.0 - (1.0 - eps) * t
  if kind == "linear":
    return eps ** t
  return eps + (1.0 - eps) * np.cos(np.pi * t / 2.0)


def np_one_minus_alpha(kind: str, t, eps: float = EPS):
  """1 - alpha(t) without cancellation (float64 and exact identities)."""
  t = np.asarray(t, np.float64)
  if kind == "loglinear":
    return (1.0 - eps) * t
  if kind == "linear":
    return -np.expm1(t * np.log(eps))
  return (1.0 - eps) * 2.0 * np.sin(np.pi * t / 4.0) ** 2  # 1 - cos x = 2 sin^2(x/2)


def np_dalpha(kind: str, t, eps: float = EPS):
  t = np.asarray(t, np.float64)
  if kind == "loglinear":
    return -(1.0 - eps) * np.ones_like(t)
  if kind == "linear":
    return np.log(eps) * eps ** t
  return -(1.0 - eps) * (np.pi / 2.0) * np.sin(np.pi * t / 2.0)


def np_weight(kind: str, t, eps: float = EPS):
  return -np_dalpha(kind, t, eps) / np_one_minus_alpha(kind, t, eps)


def np_log_softmax_without(logits, drop: int):
  """log softmax over the classes other than `drop` (float64); -inf at `drop`."""
  z = np.asarray(logits, np.float64)
  keep = np.delete(z, drop, axis=-1)
  m = keep.max(-1, keepdims=True)
  lse = m + np.log(np.exp(keep - m).sum(-1, keepdims=True))
  out = z - lse
  out[..., drop] = -np.inf
  return out


def np_nelbo_per_token(logits, x0, masked, t, kind, mask_id):
  logp = np_log_softmax_without(logits, mask_id)
  nll = -np.take_along_axis(logp, np.asarray(x0)[..., None], -1)[..., 0]
  w = np_weight(kind, np.asarray(t, np.float64))[:, None]
  return np.where(np.asarray(masked), w * nll, 0.0)


def random_case(seed, b=3, l=7, v=11, mask_id=None):
  rng = np.random.default_rng(seed)
  mask_id = v - 1 if mask_id is None else mask_id
  logits = rng.normal(size=(b, l, v)).astype(np.float32) * 2.0
  clean = [i for i in range(v) if i != mask_id]
  x0 = rng.choice(clean, size=(b, l)).astype(np.int32)
  masked = rng.random((b, l)) < 0.5
  masked[0, 0], masked[0, 1] = True, False  # both kinds present
  return rng, logits, x0, masked, mask_id


# ------------------------------------------------------------- schedules


@pytest.mark.parametrize("kind", KINDS)
def test_schedule_endpoints_and_monotone(kind):
  s = Schedule(kind, EPS)
  assert float(s.alpha(jnp.float32(0.0))) == pytest.approx(1.0, abs=1e-7)
  assert float(s.alpha(jnp.float32(1.0))) == pytest.approx(EPS, rel=5e-5)
  t = jnp.linspace(0.0, 1.0, 101)
  a = np.asarray(s.alpha(t))
  np.testing.assert_allclose(a, np_alpha(kind, np.asarray(t)), rtol=1e-6, atol=1e-7)
  assert np.all(np.diff(a) < 0)


@pytest.mark.parametrize("kind", KINDS)
def test_dalpha_and_weight_match_finite_difference(kind):
  rng = np.random.default_rng(1)
  t = np.sort(rng.uniform(0.05, 0.98, size=37))
  h = 1e-6
  fd = (np_alpha(kind, t + h) - np_alpha(kind, t - h)) / (2 * h)  # float64 central difference
  tj = jnp.asarray(t, jnp.float32)
  t32 = np.asarray(tj, np.float64)
  fd32 = (np_alpha(kind, t32 + h) - np_alpha(kind, t32 - h)) / (2 * h)
  np.testing.assert_allclose(np_dalpha(kind, t), fd, rtol=1e-7)  # the reference itself
  s = Schedule(kind, EPS)
  np.testing.assert_allclose(np.asarray(s.dalpha(tj), np.float64), fd32, rtol=1e-5, atol=1e-7)
  w_ref = -fd32 / (1.0 - np_alpha(kind, t32))
  np.testing.assert_allclose(np.asarray(s.weight(tj), np.float64), w_ref, rtol=1e-5)
  assert np.all(np.asarray(s.weight(tj)) > 0)


def test_loglinear_weight_is_one_over_t():
  t = jnp.asarray(np.random.default_rng(2).uniform(1e-4, 1.0, size=16), jnp.float32)
  np.testing.assert_allclose(np.asarray(Schedule("loglinear", 0.01).weight(t)), 1.0 / np.asarray(t), rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_weight_accurate_near_sampling_eps(kind):
  """t as small as the default sampling_eps (1e-3) is sampled in training; the
  weight there must not lose precision to the cancellation in 1 - alpha(t)."""
  t = jnp.asarray([1e-3, 2e-3, 5e-3, 1e-2, 2e-2], jnp.float32)
  got = np.asarray(Schedule(kind, EPS).weight(t), np.float64)
  ref = np_weight(kind, np.asarray(t, np.float64))
  np.testing.assert_allclose(got, ref, rtol=1e-4)


def test_schedule_validation():
  with pytest.raises(ValueError):
    Schedule("quadratic", 1e-3)
  for bad in (0.0, 1.0, -0.1):
    with pytest.raises(ValueError):
      Schedule("loglinear", bad)


# ------------------------------------------------------------- SUBS and the NELBO


@pytest.mark.parametrize("mask_id", [10, 0, 4])
def test_subs_log_probs_invariants(mask_id):
  _, logits, x0, masked, mask_id = random_case(3, mask_id=mask_id)
  xt = np.where(masked, mask_id, x0)
  lp = np.asarray(diffusion.subs_log_probs(jnp.asarray(logits), jnp.asarray(xt), mask_id), np.float64)
  assert lp.shape == logits.shape
  # Normalised rows.
  lse = np.log(np.exp(lp).sum(-1))
  np.testing.assert_allclose(lse, 0.0, atol=1e-6)
  # Zero masking: the MASK class has (numerically) zero probability everywhere.
  assert np.all(lp[..., mask_id] < -1e6)
  # Carry-over: unmasked rows put all mass on the observed token.
  probs = np.exp(lp)
  un = ~masked
  np.testing.assert_allclose(np.take_along_axis(probs, xt[..., None], -1)[..., 0][un], 1.0, atol=1e-7)
  np.testing.assert_allclose(np.take_along_axis(lp, xt[..., None], -1)[..., 0][un], 0.0, atol=1e-7)
  # Masked rows: log softmax over the non-mask classes.
  ref = np_log_softmax_without(logits, mask_id)
  keep = [i for i in range(logits.shape[-1]) if i != mask_id]
  np.testing.assert_allclose(lp[masked][:, keep], ref[masked][:, keep], rtol=1e-5, atol=1e-5)


def test_subs_log_probs_bfloat16_logits():
  _, logits, x0, masked, mask_id = random_case(4)
  xt = np.where(masked, mask_id, x0)
  lp = diffusion.subs_log_probs(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(xt), mask_id)
  assert lp.dtype == jnp.float32
  ref = np_log_softmax_without(np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32), mask_id)
  keep = [i for i in range(logits.shape[-1]) if i != mask_id]
  np.testing.assert_allclose(np.asarray(lp)[masked][:, keep], ref[masked][:, keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_id", [10, 3])
def test_masked_token_nll_matches_subs(mask_id):
  _, logits, x0, masked, mask_id = random_case(5, mask_id=mask_id)
  xt = np.where(masked, mask_id, x0)
  nll = np.asarray(diffusion.masked_token_nll(jnp.asarray(logits), jnp.asarray(x0), mask_id))
  lp = np.asarray(diffusion.subs_log_probs(jnp.asarray(logits), jnp.asarray(xt), mask_id))
  from_subs = -np.take_along_axis(lp, x0[..., None], -1)[..., 0]
  np.testing.assert_allclose(nll[masked], from_subs[masked], rtol=1e-5, atol=1e-6)
  # And against the float64 formula everywhere (masked or not, it is the zero-masked CE).
  ref = -np.take_along_axis(np_log_softmax_without(logits, mask_id), x0[..., None], -1)[..., 0]
  np.testing.assert_allclose(nll, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_nelbo_per_token_matches_numpy(kind):
  rng, logits, x0, masked, mask_id = random_case(6 + KINDS.index(kind))
  t = rng.uniform(0.05, 1.0, size=logits.shape[0]).astype(np.float32)
  s = Schedule(kind, EPS)
  got = np.asarray(diffusion.nelbo_per_token(jnp.asarray(logits), jnp.asarray(x0), jnp.asarray(masked),
                                             jnp.asarray(t), s, mask_id), np.float64)
  ref = np_nelbo_per_token(logits, x0, masked, t, kind, mask_id)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  assert np.all(got[~masked] == 0.0)
  assert np.all(got[masked] > 0.0)
  # Batch NELBO per token.
  assert got.sum() / got.size == pytest.approx(ref.sum() / ref.size, rel=1e-5)


class Recorder:
  """A fake model: fixed logits; records what it was called with."""

  def __init__(self, logits):
    self.logits = jnp.asarray(logits)
    self.calls = []

  def __call__(self, xt, t=None):
    self.calls.append((np.asarray(xt), None if t is None else np.asarray(t)))
    return self.logits


@pytest.mark.parametrize("kind,time_conditioning",
                         [("loglinear", False), ("linear", True), ("cosine", True)])
def test_mdlm_objective_matches_numpy(kind, time_conditioning):
  rng, logits, x0, _, mask_id = random_case(9)
  model = Recorder(logits)
  obj = objectives.MDLMObjective(Schedule(kind, EPS), mask_id, time_conditioning=time_conditioning)
  key = jax.random.key(int(rng.integers(1 << 30)))
  total, count = obj(model, jnp.asarray(x0), key)
  (xt, t_seen), = model.calls
  assert (t_seen is not None) == time_conditioning
  assert float(count) == x0.size and float(total) > 0
  # With explicit times the masking is recovered from what the model saw.
  t = rng.uniform(0.05, 0.4, size=x0.shape[0]).astype(np.float32)
  model.calls.clear()
  total, count = obj(model, jnp.asarray(x0), key, t=jnp.asarray(t))
  (xt, t_seen), = model.calls
  if time_conditioning:
    np.testing.assert_array_equal(t_seen, t)
  masked = xt == mask_id
  assert masked.any() and (~masked).any()
  np.testing.assert_array_equal(xt[~masked], x0[~masked])
  ref = np_nelbo_per_token(logits, x0, masked, t, kind, mask_id)
  assert float(count) == x0.size
  assert float(total) == pytest.approx(ref.sum(), rel=1e-5)


# Monte Carlo checks of the objective. Compiles are the cost on a small CPU, so every
# MC test uses the same shapes and the jitted estimator is cached per objective.
MC_B, MC_L, MC_V, MC_MASK, MC_KEYS = 8, 16, 11, 0, 3000


@functools.lru_cache(maxsize=None)
def _mc_fn(obj):
  @jax.jit
  def many(logits, x0, keys):
    def one(key):
      total, count = obj(lambda xt, t: logits, x0, key)
      return total / count
    return jax.lax.map(one, keys)
  return many


def _mc_nelbo(obj, logits, x0, seed):
  assert logits.shape == (MC_B, MC_L, MC_V)
  keys = jax.random.split(jax.random.key(seed), MC_KEYS)
  return np.asarray(_mc_fn(obj)(jnp.asarray(logits), jnp.asarray(x0), keys), np.float64)


def _mc_obj(kind, antithetic=True):
  return objectives.MDLMObjective(Schedule(kind, EPS), MC_MASK, antithetic=antithetic, sampling_eps=1e-3)


def _expected_nelbo(kind, sampling_eps, logits, x0, mask_id, antithetic):
  """Exact E_t E_mask[NELBO per token] for a model whose logits ignore x_t.

  Given t, E_mask[w(t) 1{masked} nll] = w(t) (1 - alpha(t)) nll = -alpha'(t) nll, and
  E_{t ~ U[a, b]}[-alpha'(t)] = (alpha(a) - alpha(b)) / (b - a). Without antithetic
  every row has t ~ U[s, 1]; with it row i has t in the image of [i/B, (i+1)/B)."""
  nll = -np.take_along_axis(np_log_softmax_without(logits, mask_id), x0[..., None], -1)[..., 0]
  b = x0.shape[0]
  if antithetic:
    lo = sampling_eps + (1 - sampling_eps) * np.arange(b) / b
    hi = sampling_eps + (1 - sampling_eps) * (np.arange(b) + 1) / b
  else:
    lo, hi = np.full(b, sampling_eps), np.ones(b)
  c = (np_alpha(kind, lo) - np_alpha(kind, hi)) / (hi - lo)  # [b]
  return float((c[:, None] * nll).mean())


def _mc_case(seed):
  rng = np.random.default_rng(seed)
  x0 = rng.integers(1, MC_V, size=(MC_B, MC_L)).astype(np.int32)
  logits = rng.normal(size=(MC_B, MC_L, MC_V)).astype(np.float32)
  return rng, x0, logits


@pytest.mark.parametrize("kind,antithetic",
                         [("loglinear", True), ("linear", True), ("cosine", True), ("cosine", False)])
def test_mdlm_objective_is_unbiased(kind, antithetic):
  _, x0, logits = _mc_case(11)
  logits[: MC_B // 2] *= 3.0  # rows differ in quality, so the row -> stratum map matters
  est = _mc_nelbo(_mc_obj(kind, antithetic), logits, x0, seed=12)
  expected = _expected_nelbo(kind, 1e-3, logits, x0, MC_MASK, antithetic)
  se = est.std(ddof=1) / math.sqrt(est.size)
  assert abs(est.mean() - expected) < 4.5 * se + 1e-6, (est.mean(), expected, se)
  if antithetic and kind != "loglinear":  # the test can tell strata apart
    other = _expected_nelbo(kind, 1e-3, logits[::-1], x0[::-1], MC_MASK, antithetic)
    assert abs(other - expected) > 10 * se


def test_mdlm_objective_oracle_model_has_zero_nelbo():
  _, x0, logits = _mc_case(10)
  np.put_along_axis(logits, x0[..., None], 40.0, -1)
  logits[..., MC_MASK] = 100.0  # must be ignored (zero masking)
  est = _mc_nelbo(_mc_obj("loglinear"), logits, x0, seed=13)
  assert np.all(est >= 0.0) and est.max() < 1e-8


def test_uniform_model_nelbo_is_log_vocab():
  """Uniform over the V-1 clean tokens, log-linear: E[NELBO/token] = log(V-1) (1 - eps),
  hand-computed (E_{t~U[s,1]}[w(t) (1 - alpha(t))] = E[-alpha'(t)] = 1 - eps)."""
  rng, x0, _ = _mc_case(14)
  logits = np.broadcast_to(rng.normal(size=(MC_B, MC_L, 1)) * 3.0, (MC_B, MC_L, MC_V)).astype(np.float32).copy()
  logits[..., MC_MASK] = 50.0
  est = _mc_nelbo(_mc_obj("loglinear"), logits, x0, seed=15)
  expected = math.log(MC_V - 1) * (1 - EPS)
  se = est.std(ddof=1) / math.sqrt(est.size)
  assert abs(est.mean() - expected) < 4.5 * se, (est.mean(), expected, se)
  assert se < 0.02 * expected  # the test has power


def test_antithetic_lowers_variance():
  """Cosine schedule, identical rows: E[loss | t] varies with t, and stratifying t removes most
  of that variance (for log-linear E[loss | t] is constant and there is nothing to remove)."""
  rng = np.random.default_rng(16)
  x0 = np.broadcast_to(rng.integers(1, MC_V, size=(1, MC_L)), (MC_B, MC_L)).astype(np.int32)
  logits = np.broadcast_to(rng.normal(size=(1, MC_L, MC_V)), (MC_B, MC_L, MC_V)).astype(np.float32)
  var = {anti: _mc_nelbo(_mc_obj("cosine", anti), logits, x0, seed=17).var() for anti in (True, False)}
  assert var[True] < 0.7 * var[False], var


# ------------------------------------------------------------- times and masking


@pytest.mark.parametrize("batch", [1, 5, 8])
def test_sample_times_antithetic_strata(batch):
  for seed in range(20):
    t = np.asarray(diffusion.sample_times(jax.random.key(seed), batch, antithetic=True, sampling_eps=0.0),
                   np.float64)
    assert t.shape == (batch,)
    assert np.all((t >= 0) & (t < 1))
    np.testing.assert_array_equal(np.sort(np.floor(t * batch)), np.arange(batch))


@pytest.mark.parametrize("antithetic", [True, False])
def test_sample_times_range_and_keys(antithetic):
  s_eps, batch = 1e-3, 64
  raw = [diffusion.sample_times(jax.random.key(k), batch, antithetic=antithetic, sampling_eps=s_eps)
         for k in range(30)]
  assert raw[0].dtype == jnp.float32
  ts = [np.asarray(r, np.float64) for r in raw]
  for t in ts:
    assert t.shape == (batch,)
    assert np.all((t >= s_eps - 1e-7) & (t <= 1.0))
    if antithetic:  # undo the affine map: one draw per stratum
      u = (t - s_eps) / (1 - s_eps)
      np.testing.assert_array_equal(np.sort(np.floor(u * batch)), np.arange(batch))
  assert not np.array_equal(ts[0], ts[1])
  allt = np.concatenate(ts)
  # U[s, 1]: mean (1+s)/2, variance (1-s)^2/12.
  se = (1 - s_eps) / math.sqrt(12 * allt.size)
  assert abs(allt.mean() - (1 + s_eps) / 2) < 5 * se
  assert allt.var() == pytest.approx((1 - s_eps) ** 2 / 12, rel=0.1)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_mask_rate_and_content(kind):
  rng = np.random.default_rng(17)
  v, mask_id, l = 50, 7, 20000
  t = np.array([0.02, 0.3, 0.7, 0.99], np.float32)
  x0 = rng.choice([i for i in range(v) if i != mask_id], size=(t.size, l)).astype(np.int32)
  s = Schedule(kind, EPS)
  xt, masked = diffusion.forward_mask(jax.random.key(18), jnp.asarray(x0), jnp.asarray(t), s, mask_id)
  xt, masked = np.asarray(xt), np.asarray(masked)
  assert masked.dtype == np.bool_ and xt.shape == x0.shape
  np.testing.assert_array_equal(xt == mask_id, masked)
  np.testing.assert_array_equal(xt[~masked], x0[~masked])
  p = 1.0 - np_alpha(kind, t.astype(np.float64))
  frac = masked.mean(1)
  tol = 5 * np.sqrt(p * (1 - p) / l) + 1e-4
  assert np.all(np.abs(frac - p) < tol), (frac, p)
  # Another key masks different positions.
  _, m2 = diffusion.forward_mask(jax.random.key(19), jnp.asarray(x0), jnp.asarray(t), s, mask_id)
  assert not np.array_equal(masked, np.asarray(m2))


# ------------------------------------------------------------- AR and summaries


def test_ar_nll_matches_numpy():
  rng = np.random.default_rng(20)
  b, l, v = 3, 7, 11
  logits = rng.normal(size=(b, l, v)).astype(np.float32) * 2
  tokens = rng.integers(0, v, size=(b, l)).astype(np.int32)
  got = np.asarray(diffusion.ar_nll(jnp.asarray(logits), jnp.asarray(tokens)), np.float64)
  z = logits.astype(np.float64)
  ref = np.empty((b, l - 1))
  for i in range(b):
    for j in range(l - 1):
      row = z[i, j]
      ref[i, j] = np.log(np.exp(row - row.max()).sum()) + row.max() - row[tokens[i, j + 1]]
  assert got.shape == (b, l - 1)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  total, count = objectives.ARObjective()(lambda x: jnp.asarray(logits), jnp.asarray(tokens))
  assert float(count) == b * (l - 1)
  assert float(total) == pytest.approx(ref.sum(), rel=1e-5)


def test_summarize():
  nats = 2.345
  out = diffusion.summarize(jnp.float32(nats))
  assert out["nats_per_token"] == pytest.approx(nats, rel=1e-6)
  assert out["bits_per_token"] == pytest.approx(nats / math.log(2), rel=1e-6)
  assert out["ppl"] == pytest.approx(math.exp(nats), rel=1e-6)
  assert math.isfinite(diffusion.summarize(1e4)["ppl"])


def test_instruction_tuning_masks_and_scores_the_response_only():
  """With a loss mask, tokens outside it (the prompt) are never masked, and
  the NELBO sums the masked tokens inside it, counted over the mask."""
  rng, logits, x0, _, mask_id = random_case(11)
  loss_mask = np.zeros(x0.shape, bool)
  loss_mask[:, x0.shape[1] // 3:] = True
  model = Recorder(logits)
  obj = objectives.MDLMObjective(Schedule("loglinear", EPS), mask_id)
  t = rng.uniform(0.5, 0.9, size=x0.shape[0]).astype(np.float32)
  total, count = obj(model, jnp.asarray(x0), jax.random.key(3), t=jnp.asarray(t), loss_mask=jnp.asarray(loss_mask))
  (xt, _), = model.calls
  masked = xt == mask_id
  assert masked.any() and not masked[~loss_mask].any()
  np.testing.assert_array_equal(xt[~loss_mask], x0[~loss_mask])
  ref = np_nelbo_per_token(logits, x0, masked, t, "loglinear", mask_id)
  assert float(count) == loss_mask.sum() and float(total) == pytest.approx(ref.sum(), rel=1e-5)
  # The AR twin scores token i from the tokens before it, where the mask allows.
  ar_total, ar_count = objectives.ARObjective()(lambda tokens: jnp.asarray(logits), jnp.asarray(x0),
                                                loss_mask=jnp.asarray(loss_mask))
  z = np.asarray(logits, np.float64)
  logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
  want = -sum(logp[b, i - 1, x0[b, i]] for b in range(x0.shape[0]) for i in range(1, x0.shape[1]) if loss_mask[b, i])
  assert float(ar_count) == loss_mask[:, 1:].sum() and float(ar_total) == pytest.approx(want, rel=1e-5)
