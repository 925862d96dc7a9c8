"""Block diffusion (BD3-LM): the attention mask, information flow through a real
model, the per-block NELBO against numpy, the MDLM limit, times, training."""

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import load_config
from mdlm_jax.diffusion import bd3 as bd
from mdlm_jax import config as config_lib, diffusion
from mdlm_jax.diffusion import objectives
from mdlm_jax.training import trainer
from mdlm_jax.model.spec import bind, model_spec
from mdlm_jax.diffusion import Schedule
from mdlm_jax.model import ModelConfig
from tests.diffusion.test_diffusion import EPS, KINDS, np_alpha, np_log_softmax_without, np_weight

TINY = ModelConfig(vocab_size=40, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64)
MASK_ID = TINY.vocab_size - 1

# ------------------------------------------------------------- the mask


def loop_mask(L, Lb, clean_causal=False):
  """The four rules of the paper, one (i, j) pair at a time; `clean_causal`: clean
  token i reads clean tokens <= i (an AR model's prefix)."""
  m = np.zeros((2 * L, 2 * L), bool)
  for i in range(2 * L):
    for j in range(2 * L):
      qi_clean, kj_clean = i >= L, j >= L
      bi, bj = (i % L) // Lb, (j % L) // Lb
      if not qi_clean and not kj_clean:
        m[i, j] = bi == bj
      elif not qi_clean and kj_clean:
        m[i, j] = bj < bi
      elif qi_clean and kj_clean:
        m[i, j] = j <= i if clean_causal else bj <= bi
      else:
        m[i, j] = False
  return m


@pytest.mark.parametrize("clean_causal", [False, True])
@pytest.mark.parametrize("L,Lb", [(8, 1), (8, 2), (8, 4), (8, 8), (12, 3)])
def test_mask_matches_loops(L, Lb, clean_causal):
  m = bd.block_attention_mask(L, Lb, clean_causal=clean_causal)
  assert m.shape == (2 * L, 2 * L) and m.dtype == np.bool_
  np.testing.assert_array_equal(m, loop_mask(L, Lb, clean_causal))
  assert not m[L:, :L].any()  # the clean half never sees noise
  for b in range(L // Lb):  # each noisy block sees all of itself
    s = slice(b * Lb, (b + 1) * Lb)
    assert m[s, s].all()
  assert not m[:Lb, L:].any()  # block 0 has no clean context
  assert m.diagonal().all()  # every query has a key: no empty softmax rows
  np.testing.assert_array_equal(bd.block_positions(L), np.r_[np.arange(L), np.arange(L)])


def test_mask_rejects_bad_block_size():
  for bad in (0, 3, -2):
    with pytest.raises(ValueError):
      bd.block_attention_mask(8, bad)


# ------------------------------------------------------------- a real model


@functools.lru_cache(maxsize=None)
def tiny_model(shift_logits: bool = False):
  """Spec and numpy-drawn params: jitting the random init costs ~10 s on a
  loaded 2-core CPU, far more than the forward passes under test."""
  spec = model_spec(dataclasses.replace(TINY, shift_logits=shift_logits), None)
  rng = np.random.default_rng(0)

  def leaf(path, x):
    if len(x.shape) == 1:  # norm scales
      return jnp.ones(x.shape, jnp.float32)
    fan_in = 1 if path[-1].key == "embedding" else x.shape[0]
    return jnp.asarray(rng.normal(size=x.shape) / math.sqrt(fan_in), jnp.float32)

  return spec, jax.tree_util.tree_map_with_path(leaf, spec.abstract)


@pytest.mark.parametrize("shift_logits", [False, True])
def test_information_flow(shift_logits):
  """Logits of noisy block b depend on x_t only through block b, on x_0 only
  through blocks < b, and do depend on the clean block b - 1 (with a shifted
  head too: a block's first token is scored from clean token b * L' - 1)."""
  L, Lb = 8, 2
  n = L // Lb
  rng = np.random.default_rng(0)
  x0 = rng.integers(0, MASK_ID, size=L)
  xt = np.where(rng.random(L) < 0.5, MASK_ID, x0)
  other = lambda a, where: np.where(where, (a + 1 + rng.integers(0, MASK_ID - 1, size=L)) % MASK_ID, a)
  blk = np.arange(L) // Lb
  rows, cases = [(xt, x0)], []
  for b in range(n):
    rows.append((other(xt, blk != b), x0)); cases.append((b, "xt other blocks", False))
    rows.append((xt, other(x0, blk >= b))); cases.append((b, "x0 blocks >= b", False))
    if b > 0:
      rows.append((xt, other(x0, blk == b - 1))); cases.append((b, "x0 block b-1", True))
  xts, x0s = (jnp.asarray(np.stack(r), jnp.int32) for r in zip(*rows))
  spec, params = tiny_model(shift_logits)
  logits = jax.jit(lambda p, xt, x0: bd.block_logits(bind(spec, p), xt, x0, Lb))
  out = np.asarray(logits(params, xts, x0s))
  assert out.shape == (len(rows), L, TINY.vocab_size)
  for row, (b, what, changes) in enumerate(cases, start=1):
    diff = np.abs(out[row, blk == b] - out[0, blk == b]).max()
    if changes:
      assert diff > 1e-3, (b, what, diff)
    else:
      assert diff < 1e-6, (b, what, diff)


def test_shifted_head_scores_each_token_from_its_predecessor():
  """With model.shift_logits, noisy token i is scored from the unshifted
  network's state at noisy i - 1 inside a block and at clean i - 1 at a
  block's first token (token 0 from itself), picked here by a plain loop."""
  L, Lb = 12, 4
  rng = np.random.default_rng(3)
  x0 = jnp.asarray(rng.integers(0, MASK_ID, size=(2, L)), jnp.int32)
  xt = jnp.where(jnp.asarray(rng.random((2, L)) < 0.5), MASK_ID, x0)
  spec, params = tiny_model(True)
  shifted = np.asarray(jax.jit(lambda p: bd.block_logits(bind(spec, p), xt, x0, Lb))(params))
  plain_spec, _ = tiny_model(False)

  def states(p):
    m = bind(plain_spec, p)
    tokens = jnp.concatenate([xt, x0], axis=1)
    pos = jnp.broadcast_to(jnp.asarray(bd.block_positions(L)), (2, 2 * L))
    from mdlm_jax import kernels
    return m.hidden_states(tokens, None, pos, kernels.AttentionMask(kind="block_diffusion", block_size=Lb))

  h = jax.jit(states)(params)
  source = [0] + [L + i - 1 if i % Lb == 0 else i - 1 for i in range(1, L)]
  want = np.asarray(bind(plain_spec, params).logits(h[:, np.asarray(source)]))
  np.testing.assert_allclose(shifted, want, rtol=1e-5, atol=1e-5)
  assert np.abs(shifted - np.asarray(jax.jit(
      lambda p: bd.block_logits(bind(plain_spec, p), xt, x0, Lb))(params))).max() > 1e-2


def test_block_size_seq_len_is_mdlm():
  """One block: x_t never sees x_0 and the same key draws the same times and
  masks, so the loss is MDLM's on the same network."""
  spec, params = tiny_model()
  B, L = 4, 16
  x0 = jnp.asarray(np.random.default_rng(1).integers(0, MASK_ID, size=(B, L)), jnp.int32)
  s = Schedule("cosine", EPS)
  bd3 = objectives.BD3Objective(s, MASK_ID, block_size=L)
  mdlm = objectives.MDLMObjective(s, MASK_ID)
  run = jax.jit(lambda obj, p, x, k: obj(bind(spec, p), x, k), static_argnums=0)
  for seed in range(2):
    key = jax.random.key(seed)
    (a, na), (b, nb) = run(bd3, params, x0, key), run(mdlm, params, x0, key)
    assert float(na) == float(nb) == B * L
    assert float(a) == pytest.approx(float(b), rel=1e-5)
    assert float(a) > 0


# ------------------------------------------------------------- the NELBO


@pytest.mark.parametrize("kind", KINDS)
def test_block_nelbo_matches_numpy(kind):
  rng = np.random.default_rng(2 + KINDS.index(kind))
  B, L, n, V, mask_id = 3, 12, 4, 11, 5
  logits = rng.normal(size=(B, L, V)).astype(np.float32) * 2
  x0 = rng.choice([i for i in range(V) if i != mask_id], size=(B, L)).astype(np.int32)
  masked = rng.random((B, L)) < 0.5
  t = rng.uniform(0.01, 1.0, size=(B, n)).astype(np.float32)
  got = np.asarray(bd.block_nelbo_per_token(jnp.asarray(logits), jnp.asarray(x0), jnp.asarray(masked),
                                            jnp.asarray(t), Schedule(kind, EPS), mask_id), np.float64)
  nll = -np.take_along_axis(np_log_softmax_without(logits, mask_id), x0[..., None], -1)[..., 0]
  ref = np.zeros((B, L))
  for i in range(B):
    for l in range(L):
      if masked[i, l]:
        ref[i, l] = np_weight(kind, np.float64(t[i, l // (L // n)])) * nll[i, l]
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  assert np.all(got[~masked] == 0.0)


class Recorder:
  """A fake model: fixed logits for the x_t half; records its inputs. The
  "hidden states" are the logits themselves, and `logits` is the identity."""
  cfg = TINY

  def __init__(self, logits, record=True):
    self.fixed_logits = jnp.asarray(logits)
    self.record, self.calls = record, []

  def hidden_states(self, tokens, t=None, positions=None, mask=None, noisy=None):
    if self.record:
      self.calls.append(tuple(None if a is None else np.asarray(a) for a in (tokens, t, positions)) + (mask,))
    pad = jnp.zeros_like(self.fixed_logits)
    return jnp.concatenate([self.fixed_logits, pad], axis=1)

  def logits(self, hidden):
    return hidden

  def __call__(self, tokens, t=None, positions=None, mask=None):
    return self.logits(self.hidden_states(tokens, t, positions, mask))


def test_bd3_objective_matches_numpy():
  rng = np.random.default_rng(5)
  B, L, Lb, V, mask_id = 3, 12, 3, 11, 0
  logits = rng.normal(size=(B, L, V)).astype(np.float32)
  x0 = rng.integers(1, V, size=(B, L)).astype(np.int32)
  t = rng.uniform(0.2, 0.8, size=(B, L // Lb)).astype(np.float32)
  model = Recorder(logits)
  obj = objectives.BD3Objective(Schedule("linear", EPS), mask_id, block_size=Lb)
  total, count = obj(model, jnp.asarray(x0), jax.random.key(6), t=jnp.asarray(t))
  (tokens, t_seen, positions, mask), = model.calls
  assert t_seen is None
  np.testing.assert_array_equal(tokens[:, L:], x0)
  np.testing.assert_array_equal(positions, np.broadcast_to(bd.block_positions(L), (B, 2 * L)))
  # A structural mask (kernels build it per tile) whose materialisation is the BD3 mask.
  assert mask.kind == "block_diffusion" and mask.block_size == Lb
  np.testing.assert_array_equal(np.asarray(mask.dense(2 * L, 2 * L))[0, 0], loop_mask(L, Lb))
  xt = tokens[:, :L]
  masked = xt == mask_id
  assert masked.any() and (~masked).any()
  np.testing.assert_array_equal(xt[~masked], x0[~masked])
  nll = -np.take_along_axis(np_log_softmax_without(logits, mask_id), x0[..., None], -1)[..., 0]
  w = np_weight("linear", np.repeat(t.astype(np.float64), Lb, axis=1))
  assert float(count) == x0.size
  assert float(total) == pytest.approx(np.where(masked, w * nll, 0.0).sum(), rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_complementary_views_score_every_token_once_and_match_numpy(kind):
  """Complementary masks: each row is seen twice, the second view masking exactly the scorable tokens the
  first leaves in view, at the t' with alpha(t') = 1 - alpha(t) (the inverse in float64 below); the term
  is the mean of the views' NELBO terms."""
  rng = np.random.default_rng()
  B, L, Lb, V, mask_id = 3, 24, 3, 11, 0
  logits = rng.normal(size=(2 * B, L, V)).astype(np.float32)
  x0 = rng.integers(1, V, size=(B, L)).astype(np.int32)
  # Times where alpha(t) is in [0.25, 0.75], so that both views mask some of the ~50 scorable tokens.
  t = np.asarray(Schedule(kind, EPS).time_of(rng.uniform(0.25, 0.75, size=(B, L // Lb))), np.float32)
  loss_mask = rng.random((B, L)) < 0.7
  model = Recorder(logits)
  obj = objectives.BD3Objective(Schedule(kind, EPS), mask_id, block_size=Lb, complementary=True)
  per = np.asarray(obj.per_token(model, jnp.asarray(x0), jax.random.key(int(rng.integers(1 << 30))),
                                 t=jnp.asarray(t), loss_mask=jnp.asarray(loss_mask)), np.float64)
  (tokens, _, _, _), = model.calls
  xt = tokens[:, :L]
  np.testing.assert_array_equal(tokens[:, L:], np.concatenate([x0, x0]))
  first, second = xt[:B] == mask_id, xt[B:] == mask_id
  np.testing.assert_array_equal(first ^ second, loss_mask)  # every scorable token masked in exactly one view
  assert not (first & second).any() and first.any() and second.any()
  alpha = np_alpha(kind, np.repeat(t.astype(np.float64), Lb, axis=1))
  target = 1.0 - alpha  # alpha(t') for the second view, solved for t' by bisection
  lo, hi = np.zeros_like(target), np.ones_like(target)
  for _ in range(60):
    mid = (lo + hi) / 2
    low = np_alpha(kind, mid) > target  # alpha falls with t
    lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
  t2 = (lo + hi) / 2
  nll = -np.take_along_axis(np_log_softmax_without(logits, mask_id), np.concatenate([x0, x0])[..., None], -1)[..., 0]
  w = np.concatenate([np_weight(kind, np.repeat(t.astype(np.float64), Lb, axis=1)), np_weight(kind, t2)])
  terms = np.where(np.concatenate([first, second]), w * nll, 0.0)
  np.testing.assert_allclose(per, 0.5 * (terms[:B] + terms[B:]), rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_position_dependent_masking_matches_numpy(kind):
  """position_slope s: token j of a block of n is masked at time c_j t, c_j = 1 + s (2 j / (n - 1) - 1),
  with weight c_j w(c_j t) (0 once c_j t reaches 1): a float64 reference, and each position's mask rate
  over many draws."""
  rng = np.random.default_rng()
  B, L, Lb, V, mask_id, slope = 3, 12, 4, 11, 0, float(rng.uniform(0.1, 0.6))
  logits = rng.normal(size=(B, L, V)).astype(np.float32)
  x0 = rng.integers(1, V, size=(B, L)).astype(np.int32)
  t = rng.uniform(0.2, 0.9, size=(B, L // Lb)).astype(np.float32)
  model = Recorder(logits)
  obj = objectives.BD3Objective(Schedule(kind, EPS), mask_id, block_size=Lb, position_slope=slope)
  per = np.asarray(obj.per_token(model, jnp.asarray(x0), jax.random.key(int(rng.integers(1 << 30))),
                                 t=jnp.asarray(t)), np.float64)
  (tokens, _, _, _), = model.calls
  masked = tokens[:, :L] == mask_id
  c = np.tile(1.0 + slope * (2.0 * np.arange(Lb) / (Lb - 1) - 1.0), L // Lb)
  own = np.repeat(t.astype(np.float64), Lb, axis=1) * c
  w = np.where(own < 1.0, c * np_weight(kind, np.minimum(own, 1.0)), 0.0)
  nll = -np.take_along_axis(np_log_softmax_without(logits, mask_id), x0[..., None], -1)[..., 0]
  np.testing.assert_allclose(per, np.where(masked, w * nll, 0.0), rtol=2e-4, atol=1e-6)
  # Mask rates: 1 - alpha(min(c_j t, 1)) at each position, within 5 binomial standard errors.
  K = 4000
  draws = jax.vmap(lambda k: bd.block_forward_mask(k, jnp.asarray(x0), jnp.asarray(t), Schedule(kind, EPS),
                                                   mask_id, slope)[1])(jax.random.split(jax.random.key(1), K))
  rate = np.asarray(draws, np.float64).mean(0)
  want = 1.0 - np_alpha(kind, np.minimum(own, 1.0))
  assert np.all(np.abs(rate - want) < 5 * np.sqrt(want * (1 - want) / K) + 1e-3)


def test_bd3_objective_is_unbiased():
  """Logits that ignore the input, of a quality that differs by block: the
  Monte Carlo mean must match sum_l E_t[-alpha'(t)] nll_l for every block
  (a fixed row-major block -> stratum map would fail this)."""
  B, L, Lb, V, K = 2, 8, 2, 7, 2000
  rng = np.random.default_rng(7)
  x0 = rng.integers(1, V, size=(B, L)).astype(np.int32)
  logits = rng.normal(size=(B, L, V)).astype(np.float32)
  logits[:, :Lb] *= 4.0
  obj = objectives.BD3Objective(Schedule("cosine", EPS), 0, block_size=Lb)
  fake = Recorder(logits, record=False)
  keys = jax.random.split(jax.random.key(8), K)
  est = np.asarray(jax.jit(lambda ks: jax.lax.map(lambda k: obj(fake, jnp.asarray(x0), k)[0] / x0.size, ks))(keys),
                   np.float64)
  nll = -np.take_along_axis(np_log_softmax_without(logits, 0), x0[..., None], -1)[..., 0]
  expected = (np_alpha("cosine", 1e-3) - np_alpha("cosine", 1.0)) / (1 - 1e-3) * nll.mean()
  se = est.std(ddof=1) / math.sqrt(K)
  assert abs(est.mean() - expected) < 4.5 * se, (est.mean(), expected, se)


# ------------------------------------------------------------- times


@pytest.mark.parametrize("batch,n,antithetic", [(2, 4, True), (3, 5, True), (2, 4, False)])
def test_block_times_strata_and_range(batch, n, antithetic):
  """t in [eps, 1]; every (row, block) slot marginally U[eps, 1] (mean
  (1 + eps) / 2); antithetic: each of the batch * n strata exactly once."""
  s_eps, K = 1e-3, 400
  keys = jax.random.split(jax.random.key(9), K)
  t = jax.jit(jax.vmap(lambda k: bd.sample_block_times(k, batch, n, antithetic, s_eps)))(keys)
  assert t.dtype == jnp.float32 and t.shape == (K, batch, n)
  t = np.asarray(t, np.float64)
  assert np.all((t >= s_eps - 1e-7) & (t <= 1.0))
  assert np.all(np.abs(t.mean(0) - (1 + s_eps) / 2) < 5 / math.sqrt(12 * K)), t.mean(0)
  assert not np.array_equal(t[0], t[1])
  if antithetic:
    strata = np.sort(np.floor((t - s_eps) / (1 - s_eps) * batch * n).reshape(K, -1), axis=1)
    np.testing.assert_array_equal(strata, np.broadcast_to(np.arange(batch * n), strata.shape))


def test_one_block_times_are_mdlm_times():
  key = jax.random.key(10)
  np.testing.assert_array_equal(np.asarray(bd.sample_block_times(key, 6, 1, True, 1e-3))[:, 0],
                                np.asarray(diffusion.sample_times(key, 6, antithetic=True, sampling_eps=1e-3)))


@pytest.mark.parametrize("n", [1, 6])
def test_clipped_block_times_cover_exactly_the_range(n):
  """BD3-LM's clipped schedule: every t in [lo, hi], uniform there (mean
  (lo + hi) / 2), antithetic strata over [lo, hi]."""
  lo, hi, batch, K = 0.3, 0.8, 4, 300
  keys = jax.random.split(jax.random.key(11), K)
  t = np.asarray(jax.vmap(lambda k: bd.sample_block_times(k, batch, n, True, lo, hi))(keys), np.float64)
  assert np.all((t >= lo - 1e-7) & (t <= hi + 1e-7))
  assert abs(t.mean() - (lo + hi) / 2) < 5 * (hi - lo) / math.sqrt(12 * t.size)
  strata = np.sort(np.floor((t - lo) / (hi - lo) * batch * n).reshape(K, -1), axis=1)
  np.testing.assert_array_equal(strata, np.broadcast_to(np.arange(batch * n), strata.shape))


def test_train_t_range_applies_to_training_only(tiny_config):
  c = tiny_config
  for block_size in (0, 16):
    c.diffusion.block_size = block_size
    c.diffusion.update(train_t_min=0.3, train_t_max=0.8)
    config_lib.validate(c)
    train = objectives.from_config(c, 3, training=True)
    full = objectives.from_config(c, 3)
    assert (train.sampling_eps, train.t_max) == (0.3, 0.8)
    assert (full.sampling_eps, full.t_max) == (c.diffusion.sampling_eps, 1.0)
    c.diffusion.update(train_t_min=0.0, train_t_max=1.0)
    off = objectives.from_config(c, 3, training=True)
    assert (off.sampling_eps, off.t_max) == (c.diffusion.sampling_eps, 1.0)
  for (lo, hi), field in [((0.8, 0.3), "train_t_min"), ((-0.1, 0.5), "train_t_min"), ((0.5, 1.5), "train_t_max"),
                          ((0.0, 0.0), "train_t_max"), ((0.0, 0.0005), "train_t_min")]:
    c.diffusion.update(train_t_min=lo, train_t_max=hi)
    with pytest.raises(config_lib.ConfigError, match=f"diffusion.{field}"):
      config_lib.validate(c)


def test_distillation_applies_to_adapted_models_in_training_only(tiny_config):
  c = tiny_config
  c.diffusion.block_size = 16
  c.diffusion.distill_weight = 0.5
  with pytest.raises(config_lib.ConfigError, match="diffusion.distill_weight.*clean_causal"):
    config_lib.validate(c)
  c.model.update(shift_logits=True, clean_causal=True)
  config_lib.validate(c)
  assert objectives.from_config(c, 3, training=True).distill_weight == 0.5
  assert objectives.from_config(c, 3).distill_weight == 0.0  # the bound stays the NELBO
  for bad in (-0.1, 1.5):
    c.diffusion.distill_weight = bad
    with pytest.raises(config_lib.ConfigError, match="diffusion.distill_weight"):
      config_lib.validate(c)


def test_complementary_masks_apply_to_block_diffusion_in_training_only(tiny_config):
  c = tiny_config
  c.diffusion.complementary_masks = True
  with pytest.raises(config_lib.ConfigError, match="diffusion.complementary_masks"):
    config_lib.validate(c)  # plain MDLM
  c.diffusion.block_size = 16
  config_lib.validate(c)
  assert objectives.from_config(c, 3, training=True).complementary
  assert not objectives.from_config(c, 3).complementary  # the bound is the plain NELBO


def test_position_dependent_masking_is_block_diffusion_training_only(tiny_config):
  c = tiny_config
  c.diffusion.position_mask_slope = 0.3
  with pytest.raises(config_lib.ConfigError, match="diffusion.position_mask_slope"):
    config_lib.validate(c)  # plain MDLM
  c.diffusion.block_size = 16
  config_lib.validate(c)
  assert objectives.from_config(c, 3, training=True).position_slope == pytest.approx(0.3)
  assert objectives.from_config(c, 3).position_slope == 0.0
  c.diffusion.complementary_masks = True
  with pytest.raises(config_lib.ConfigError, match="diffusion.position_mask_slope"):
    config_lib.validate(c)
  c.diffusion.complementary_masks = False
  c.diffusion.position_mask_slope = 1.0
  with pytest.raises(config_lib.ConfigError, match="diffusion.position_mask_slope"):
    config_lib.validate(c)


def test_the_ar_loss_trains_a_whole_adapted_model_only(tiny_config):
  c = tiny_config
  c.diffusion.update(block_size=16, ar_weight=0.5)
  with pytest.raises(config_lib.ConfigError, match="diffusion.ar_weight.*clean_causal"):
    config_lib.validate(c)
  c.model.update(shift_logits=True, clean_causal=True, lora_rank=4)
  c.train.trainable = "adapters"
  with pytest.raises(config_lib.ConfigError, match="diffusion.ar_weight"):
    config_lib.validate(c)  # a frozen base learns nothing from it
  c.train.trainable = "all"
  config_lib.validate(c)
  trained, scored = objectives.from_config(c, 3, training=True), objectives.from_config(c, 3)
  assert (trained.ar_weight, trained.frozen_base) == (0.5, False)
  assert (scored.ar_weight, scored.frozen_base) == (0.0, True)  # the bound is the NELBO


# ------------------------------------------------------------- config and training


def test_config_validation(tiny_config):
  c = tiny_config
  c.diffusion.block_size = 16
  config_lib.validate(c)
  assert isinstance(objectives.from_config(c, 3), objectives.BD3Objective)
  c.diffusion.block_size = 0
  assert type(objectives.from_config(c, 3)) is objectives.MDLMObjective
  for field, value, match in [("diffusion.block_size", 24, "divide"), ("diffusion.block_size", -1, ">= 0")]:
    c = load_config("tiny")
    c.diffusion.block_size = value
    with pytest.raises(config_lib.ConfigError, match=match):
      config_lib.validate(c)
  c = load_config("tiny")
  c.update(objective="ar")
  c.model.causal = True
  c.diffusion.block_size = 16
  with pytest.raises(config_lib.ConfigError, match="diffusion.block_size"):
    config_lib.validate(c)
  c = load_config("tiny")
  c.model.time_conditioning = True
  c.diffusion.block_size = 16
  with pytest.raises(config_lib.ConfigError, match="model.time_conditioning"):
    config_lib.validate(c)
  with pytest.raises(ValueError):
    objectives.BD3Objective(Schedule(), 3, time_conditioning=True, block_size=4)
  c = config_lib.validate(load_config("bd3_code_small"))
  assert c.diffusion.block_size == 8 and c.data.seq_len % 8 == 0


@pytest.mark.slow
def test_training_loss_falls(tiny_config, tmp_path):
  c = tiny_config
  c.diffusion.block_size = 16
  # A fixed peak skips the CPU matmul benchmark; one eval batch and draw keep the final eval cheap.
  c.train.update(num_steps=30, log_every=1, checkpoint_every=1000, eval_batches=1, peak_flops_per_device=1e10)
  c.eval.time_samples = 1
  out = trainer.train(c, str(tmp_path))
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    train = [r for r in map(json.loads, f) if r["kind"] == "train"]
  assert len(train) == 30
  first = np.mean([r["loss"] for r in train[:5]])
  last = np.mean([r["loss"] for r in train[-5:]])
  assert first - last > 0.5, (first, last)
  ev = out["eval"]
  assert ev["bound"] and np.isfinite(ev["nats_per_token"])
