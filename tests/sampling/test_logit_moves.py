"""OpenAI's logit moves (logit_bias, presence and frequency penalties) in the
refinement rule, the diffusion samplers and the AR sampler."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.sampling import rule
from mdlm_jax.sampling.ar import ARSampler
from mdlm_jax.sampling.samplers import Layout, LowConfidenceSampler, ThresholdSampler
from tests.sampling.test_samplers import generator  # noqa: F401  (fixture)


def test_penalize_matches_a_float64_formula():
  rng = np.random.default_rng()
  b, t, v, k = 3, 5, 37, 6
  logits = rng.normal(size=(b, t, v)).astype(np.float32)
  tokens = rng.integers(0, v, size=(b, 20))
  counted = rng.random((b, 20)) < 0.6
  presence, frequency = rng.uniform(-2, 2, b), rng.uniform(-2, 2, b)
  ids = np.stack([rng.choice(v, k, replace=False) for _ in range(b)]).astype(np.int32)
  values = rng.uniform(-100, 100, (b, k))
  ids[1, 4:] = rule.NO_BIAS_ID  # free entries move nothing
  values[1, 4:] = 55.0

  counts = np.asarray(rule.token_counts(jnp.asarray(tokens), jnp.asarray(counted), v))
  want_counts = np.stack([np.bincount(tokens[i][counted[i]], minlength=v) for i in range(b)]).astype(np.float64)
  np.testing.assert_array_equal(counts, want_counts)

  got = np.asarray(rule.penalize(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(presence, jnp.float32),
                                 jnp.asarray(frequency, jnp.float32), jnp.asarray(ids),
                                 jnp.asarray(values, jnp.float32)))
  want = logits.astype(np.float64).copy()
  for i in range(b):
    for tok, val in zip(ids[i], values[i]):
      if tok != rule.NO_BIAS_ID:
        want[i, :, tok] += val
    want[i] -= presence[i] * (want_counts[i] > 0) + frequency[i] * want_counts[i]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_the_greedy_proposal_of_moved_logits_is_their_maximum_in_one_program():
  """A sampler's moves, proposal and picks in one jitted program, the counts
  taken from the canvas: the proposal is the moved maximum's index, its
  confidence that token's softmax share, and the pass commits one token.
  (XLA compiled the moves into the max and into the search for its index with
  different rounding, and no index reached the max: the index past the end
  came back with a NaN confidence and nothing was committed, on this very
  canvas, so the sampler stalled.)"""
  vocab, mask_id = 12, 4
  lay = Layout(gen_start=2, gen_len=16, mask_id=mask_id, eos_id=2)
  sampler = ThresholdSampler(threshold=rule.NEVER, block_size=8, presence_penalty=0.3, frequency_penalty=0.7,
                             logit_bias=((9, -100.0),))
  row = np.linspace(-1.0, 1.0, vocab)
  row[[9, 7, 5, 3, 2]] = [5.0, 4.2, 3.1, 0.5, -50.0]
  canvas = [1, 6, 7, 7, 5, 7, 5] + [mask_id] * 11
  tokens, valid = jnp.asarray([canvas], jnp.int32), jnp.ones((1, 18), bool)
  denoise = _constant_denoise(row, vocab)
  candidates = (tokens == mask_id) & (jnp.arange(18) < 10)

  @jax.jit
  def one_pass(tokens):
    moved = sampler._moved(denoise(tokens, jnp.zeros(1)), lay, tokens, valid)
    x0, conf = rule.propose(moved, rule.pass_keys(rule.row_keys(jnp.zeros(1)), 0, 5), jnp.arange(18),
                            lay.never_proposed, 0.0)
    return moved[0, 7], x0, conf, sampler._picks(conf, candidates, 5)

  got_row, x0, conf, picked = (np.asarray(a) for a in one_pass(tokens))
  counts = np.bincount([t for t in canvas[2:] if t != mask_id], minlength=vocab)
  want = row - 0.3 * (counts > 0) - 0.7 * counts
  want[9] -= 100.0
  want[mask_id] = -np.inf
  np.testing.assert_allclose(got_row[want > -np.inf], want[want > -np.inf], rtol=1e-6)
  assert x0[0, 7] == np.argmax(want) == 7
  np.testing.assert_allclose(conf[0, 7], np.exp(want.max() - np.log(np.exp(want).sum())), rtol=1e-5)
  assert picked.sum() == 1 and picked[0, 7]


def _constant_denoise(row_logits, vocab):
  """A 'model' whose logits are the same at every position, whatever the canvas."""
  logits = jnp.asarray(row_logits, jnp.float32)
  return lambda tokens, t: jnp.broadcast_to(logits, tokens.shape + (vocab,))


def _greedy_one_per_pass(row_logits, n, presence, frequency, bias, never):
  """The rule by hand: one token a pass, the leftmost of equally sure
  positions, each pass's logits moved by what was committed before it."""
  out, counts = [], np.zeros(len(row_logits))
  for _ in range(n):
    moved = np.asarray(row_logits, np.float64) - presence * (counts > 0) - frequency * counts
    for tok, val in bias:
      moved[tok] += val
    moved[list(never)] = -np.inf
    tok = int(np.argmax(moved))
    out.append(tok)
    counts[tok] += 1
  return out


@pytest.mark.parametrize("presence,frequency,bias", [(0.0, 1.5, ()), (1.2, 0.0, ()), (0.3, 0.7, ((9, -100.0),)),
                                                     (0.0, 0.0, ((3, 100.0),))])
@pytest.mark.parametrize("kv_cache", [False, True])
def test_threshold_sampler_moves_logits_by_what_it_committed(presence, frequency, bias, kv_cache):
  vocab, mask_id, eos_id = 12, 4, 2
  row_logits = np.linspace(-1.0, 1.0, vocab)  # no ties
  row_logits[[9, 7, 5, 3, eos_id]] = [5.0, 4.2, 3.1, 0.5, -50.0]
  lay = Layout(gen_start=2, gen_len=16, mask_id=mask_id, eos_id=eos_id)
  tokens = jnp.full((1, 18), mask_id, jnp.int32).at[0, :2].set(jnp.array([1, 6]))
  sampler = ThresholdSampler(threshold=rule.NEVER, min_tokens=1, block_size=8, presence_penalty=presence,
                             frequency_penalty=frequency, logit_bias=bias)
  denoise = _constant_denoise(row_logits, vocab)
  if kv_cache:
    sampler = dataclasses.replace(sampler, kv_cache=True)
    denoise = _CachedConstant(row_logits, vocab, tokens.shape[1])
  # Jitted as the generators run it: eager, its passes' op-by-op dispatch took seconds.
  out = jax.jit(lambda t: sampler.run(denoise, t, jnp.ones((1, 18), bool), rule.row_keys(jnp.zeros(1)), lay))(tokens)
  want = _greedy_one_per_pass(row_logits, 16, presence, frequency, bias, lay.never_proposed)
  assert np.asarray(out["tokens"][0, 2:]).tolist() == want
  assert len(set(want)) > 1 or bias  # the case moves the greedy choice


class _CachedConstant:
  """`_run_cached`'s model interface around constant logits."""

  def __init__(self, row_logits, vocab, length):
    self.logits, self.vocab = jnp.asarray(row_logits, jnp.float32), vocab
    self.positions = jnp.arange(length)[None]

  def new_cache(self, batch, max_len):
    return jnp.zeros(())

  def cached(self, tokens, positions, cache, commit, valid_new, commit_len, new_block, **_):
    return jnp.broadcast_to(self.logits, (tokens.shape[0], new_block or tokens.shape[1], self.vocab)), cache


@pytest.mark.slow  # heavy end-to-end: outside the default run
def test_banned_token_never_appears_and_forced_token_fills_the_draft(generator):  # noqa: F811
  base = ThresholdSampler(threshold=0.1, block_size=8, temperature=0.0, kv_cache=True)
  free = generator.generate(["def f(x):\n"], max_new_tokens=16, sampler=base, seed=1).completions[0].tokens
  common = max(set(free), key=free.count)
  banned = generator.generate(["def f(x):\n"], max_new_tokens=16, seed=1,
                              sampler=dataclasses.replace(base, logit_bias=((common, -100.0),))).completions[0].tokens
  assert common not in banned
  forced = generator.generate(["def f(x):\n"], max_new_tokens=16, seed=1,
                              sampler=dataclasses.replace(base, logit_bias={common: 100.0})).completions[0].tokens
  assert forced == [common] * 16


def test_penalties_cut_repeats_for_ar_and_diffusion(generator):  # noqa: F811
  """A frequency penalty at its largest leaves fewer repeated tokens than none."""
  def repeats(tokens):
    return len(tokens) - len(set(tokens))
  base = LowConfidenceSampler(steps=16, block_size=16, kv_cache=True)
  free = generator.generate(["x = "], max_new_tokens=16, sampler=base, seed=0).completions[0].tokens
  moved = generator.generate(["x = "], max_new_tokens=16, seed=0,
                             sampler=dataclasses.replace(base, frequency_penalty=2.0,
                                                         presence_penalty=2.0)).completions[0].tokens
  assert repeats(free) > 0 and repeats(moved) < repeats(free)


def test_ar_sampler_moves_logits_as_an_uncached_reference():
  """Greedy AR decoding with the moves against re-running the model on each
  row's growing sequence and moving its last logits by hand (float64)."""
  import jax
  from tests.sampling import test_ar_sampler as ar
  spec, params, real, prompt, valid = ar.setup()
  free = ar.generate(ar.GREEDY, prompt, valid)["tokens"]
  presence, frequency, bias = 0.8, 1.3, ((int(free[0, 0]), -100.0), (7, 2.5))
  got = ar.generate(ARSampler(ar.N, temperature=0.0, presence_penalty=presence, frequency_penalty=frequency,
                              logit_bias=bias), prompt, valid)["tokens"]
  forward = jax.jit(lambda params, tokens: ar.bind(spec, params)(tokens))
  buf = np.zeros((2, ar.P + ar.N), np.int32)
  buf[:, :ar.P] = real
  counts = np.zeros((2, ar.CFG.vocab_size))
  for i in range(ar.N):
    logits = np.asarray(forward(params, jnp.asarray(buf)), np.float64)
    for r in range(2):
      moved = logits[r, ar.N_REAL[r] + i - 1] - presence * (counts[r] > 0) - frequency * counts[r]
      for tok, val in bias:
        moved[tok] += val
      buf[r, ar.N_REAL[r] + i] = tok = int(moved.argmax())
      counts[r, tok] += 1
  want = np.stack([buf[r, ar.N_REAL[r]:ar.N_REAL[r] + ar.N] for r in range(2)])
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got, free)


@pytest.mark.parametrize("kwargs,match", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in"),
    ({"logit_bias": ((1, 101.0),)}, "must be in \\[-100, 100\\]"),
    ({"logit_bias": ((-1, 1.0),)}, "non-negative integers"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "appears twice"),
    ({"logit_bias": tuple((i, 1.0) for i in range(rule.MAX_LOGIT_BIAS + 1))}, "at most"),
])
@pytest.mark.parametrize("make", [lambda **k: ThresholdSampler(**k), lambda **k: ARSampler(4, **k)],
                         ids=["threshold", "ar"])
def test_bad_moves_are_refused_naming_the_field(make, kwargs, match):
  with pytest.raises(ValueError, match=match):
    make(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused(generator):  # noqa: F811
  vocab = generator.loaded.spec.cfg.vocab_size
  with pytest.raises(ValueError, match=f"outside the vocabulary of {vocab}"):
    generator.generate(["a"], max_new_tokens=8, seed=0,
                       sampler=ThresholdSampler(block_size=8, kv_cache=True, logit_bias=((vocab, 1.0),)))
