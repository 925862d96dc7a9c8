"""`rule.choose` and `rule.confidence`, the two halves of `rule.propose`, and
`rule.odds_where_asked`: against float64 numpy formulas on fresh random logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.sampling import rule

NEVER = (3, 11)


def _logits(rng, b=2, t=5, v=300):
  return rng.normal(size=(b, t, v)).astype(np.float32) * 4.0


def _softmax64(x):
  x = np.asarray(x, np.float64).copy()
  x[..., list(NEVER)] = -np.inf
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_choose_then_confidence_is_propose(temperature):
  rng = np.random.default_rng()
  logits = jnp.asarray(_logits(rng))
  keys = rule.pass_keys(rule.row_keys(jnp.asarray(rng.integers(0, 1000, 2))), 0, 0)
  columns = jnp.arange(5)
  x0, conf = rule.propose(logits, keys, columns, NEVER, temperature)
  chosen = rule.choose(logits, keys, columns, NEVER, temperature)
  np.testing.assert_array_equal(np.asarray(chosen), np.asarray(x0))
  tail = rule.confidence(logits[:, 2:], chosen[:, 2:], NEVER)  # a few columns alone, as a revising pass asks
  np.testing.assert_allclose(np.asarray(tail), np.asarray(conf)[:, 2:], rtol=1e-6)
  probs = _softmax64(logits)
  want = np.take_along_axis(probs, np.asarray(x0)[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(conf), want, rtol=1e-5)
  assert not np.isin(np.asarray(x0), NEVER).any()
  if temperature == 0.0:
    np.testing.assert_array_equal(np.asarray(x0), probs.argmax(-1))


def test_odds_are_computed_only_where_some_row_asks_for_agreement():
  rng = np.random.default_rng()
  logits = jnp.asarray(_logits(rng))
  head = jnp.asarray(rng.integers(12, 300, (2, 5)), jnp.int32)
  wider = jnp.concatenate([logits, jnp.asarray(_logits(rng, t=2))], 1)  # a tail after the head: not read
  f = jax.jit(lambda agreement: rule.odds_where_asked(wider, head, NEVER, agreement))
  probs = _softmax64(logits)
  want = np.log(np.take_along_axis(probs, np.asarray(head)[..., None], -1)[..., 0]) - np.log(probs.max(-1))
  np.testing.assert_allclose(np.asarray(f(jnp.asarray([1.0, 0.5]))), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(rule.draft_odds(logits, head, NEVER)), want, rtol=1e-5, atol=1e-5)
  ones = np.asarray(f(jnp.ones(2)))
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(ones, np.zeros((2, 5)))
  # Either way verify keeps what the base chooses alone when no row asks.
  base = jnp.asarray(probs.argmax(-1), jnp.int32)
  for odds in (jnp.asarray(ones), jnp.asarray(want, jnp.float32)):
    v = rule.verify(head, jnp.full((2,), 4), base, base, jnp.ones((2, 5)), 0.3, 0, jnp.full((2,), 99), odds,
                    jnp.ones(2))
    held = np.asarray(head)[:, 1:] == np.asarray(base)[:, 1:]
    np.testing.assert_array_equal(np.asarray(v.keep), 1 + np.cumprod(held, 1).sum(1))
