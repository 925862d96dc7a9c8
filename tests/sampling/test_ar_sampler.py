"""ARSampler: KV-cached generation against an uncached greedy loop; EOS, seeds, top-p, left padding."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax.model.spec import bind, model_spec
from mdlm_jax.model import ModelConfig
from mdlm_jax.sampling.ar import ARSampler, sample_token
from tests.model.test_kv_cache import random_params

CFG = ModelConfig(vocab_size=50, num_layers=2, embed_dim=32, num_heads=4, mlp_dim=64, causal=True,
                  tie_embeddings=False)
N = 8
P = 6
N_REAL = np.array([P, 4])  # row 1 is left-padded by 2
PAD = 1
GREEDY = ARSampler(N, temperature=0.0)


@functools.lru_cache(maxsize=None)
def setup():
  spec = model_spec(CFG, None)
  params = random_params(spec.abstract, 5)
  # Smaller embeddings than N(0, 1): the residual stream is then not just the input token,
  # and greedy decoding of a random model repeats itself less.
  params["embedding"] = params["embedding"] * 0.3
  real = np.random.default_rng(6).integers(0, CFG.vocab_size, size=(2, P)).astype(np.int32)
  prompt = np.full((2, P), PAD, np.int32)
  for r in range(2):
    prompt[r, P - N_REAL[r]:] = real[r, :N_REAL[r]]
  valid = np.arange(P)[None, :] >= (P - N_REAL)[:, None]
  return spec, params, real, prompt, valid


def generate(sampler, prompt, valid, seed=0, eos_id=-1):
  spec, params, *_ = setup()
  out = sampler.generate(spec, params, jnp.asarray(prompt), jnp.asarray(valid), jax.random.PRNGKey(seed),
                         eos_id=eos_id, pad_id=PAD)
  return {k: np.asarray(v) for k, v in out.items()}


@functools.lru_cache(maxsize=None)
def greedy_reference():
  """Uncached: re-run the full model on each row's growing unpadded sequence and take the argmax.
  Rows sit right-aligned in one fixed [2, P + N] buffer (one compile); the model is causal,
  so the not-yet-generated tail cannot affect the logits read."""
  spec, params, real, _, _ = setup()
  forward = jax.jit(lambda params, tokens: bind(spec, params)(tokens))
  buf = np.zeros((2, P + N), np.int32)
  buf[:, :P] = real
  for i in range(N):
    logits = np.asarray(forward(params, jnp.asarray(buf)))
    for r in range(2):
      buf[r, N_REAL[r] + i] = logits[r, N_REAL[r] + i - 1].argmax()
  return np.stack([buf[r, N_REAL[r]:N_REAL[r] + N] for r in range(2)])


def test_greedy_matches_uncached_reference_and_unbatched_rows():
  _, _, _, prompt, valid = setup()
  prompt_before = prompt.copy()
  out = generate(GREEDY, prompt, valid)
  np.testing.assert_array_equal(prompt, prompt_before)  # the prompt is untouched
  assert out["tokens"].shape == (2, N) and out["tokens"].dtype == np.int32
  np.testing.assert_array_equal(out["tokens"], greedy_reference())
  np.testing.assert_array_equal(out["lengths"], [N, N])  # eos_id=-1 never comes: exactly N tokens
  assert int(out["num_forward_passes"]) == N  # the prefill gives token 0, each of N - 1 steps one more
  # The left-padded row equals its own unbatched, unpadded generation.
  row = generate(GREEDY, prompt[1:, P - N_REAL[1]:], valid[1:, P - N_REAL[1]:])
  np.testing.assert_array_equal(row["tokens"][0], out["tokens"][1])


def test_eos_stops_rows_and_the_loop():
  _, _, _, prompt, valid = setup()
  greedy = greedy_reference()
  # EOS := the token some row first emits at step 3 (greedy decoding of a random model repeats a lot).
  first = [r for r in range(2) if greedy[r, 3] not in greedy[r, :3]]
  assert first, "pick another seed: no row first emits a token at step 3"
  r0 = first[0]
  eos = int(greedy[r0, 3])
  out = generate(GREEDY, prompt, valid, eos_id=eos)
  for r in range(2):
    hits = np.flatnonzero(greedy[r] == eos)
    n = int(hits[0]) if hits.size else N
    assert out["lengths"][r] == n
    np.testing.assert_array_equal(out["tokens"][r, :n], greedy[r, :n])
    if n < N:
      assert out["tokens"][r, n] == eos and np.all(out["tokens"][r, n + 1:] == PAD)
  assert out["lengths"][r0] == 3
  # Both rows stopping at step 3 ends the loop there: the prefill + 3 steps.
  both = generate(GREEDY, prompt[[r0, r0]], valid[[r0, r0]], eos_id=eos)
  np.testing.assert_array_equal(both["lengths"], [3, 3])
  np.testing.assert_array_equal(both["tokens"], np.tile(np.r_[greedy[r0, :4], [PAD] * (N - 4)], (2, 1)))
  assert int(both["num_forward_passes"]) == 4


def test_seeds():
  _, _, _, prompt, valid = setup()
  sampler = ARSampler(N, temperature=1.0)
  a, b, c = (generate(sampler, prompt, valid, seed=s)["tokens"] for s in (1, 1, 2))
  np.testing.assert_array_equal(a, b)
  assert np.any(a != c)
  assert np.all((a >= 0) & (a < CFG.vocab_size))


def test_top_p():
  """A tiny top_p keeps only the most likely token (greedy); with p = (0.5, 0.3, 0.15, 0.05) and
  top_p = 0.7 the nucleus is {0, 1}, renormalised to (5/8, 3/8). (At the level of `sample_token`:
  one more end-to-end generate would be one more compile of the whole loop.)"""
  draw = jax.jit(sample_token, static_argnames=("temperature", "top_p"))
  logits = jnp.asarray(np.random.default_rng(7).normal(size=(64, 50)) * 3, jnp.float32)
  for seed in (0, 1):
    tok = draw(logits, jax.random.PRNGKey(seed), temperature=1.0, top_p=1e-6)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(jnp.argmax(logits, -1)))
  probs = jnp.tile(jnp.asarray([[0.15, 0.5, 0.05, 0.3]]), (4000, 1))
  tok = np.asarray(draw(jnp.log(probs), jax.random.PRNGKey(0), temperature=1.0, top_p=0.7))
  assert set(np.unique(tok)) == {1, 3}
  assert abs(np.mean(tok == 1) - 5 / 8) < 0.03


def test_rejects_bad_settings():
  with pytest.raises(ValueError):
    ARSampler(0)
  with pytest.raises(ValueError):
    ARSampler(4, top_p=0.0)
  with pytest.raises(ValueError):
    ARSampler(4, temperature=-1.0)
  spec = model_spec(dataclasses.replace(CFG, causal=False), None)
  with pytest.raises(ValueError):
    GREEDY.generate(spec, None, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), bool), jax.random.PRNGKey(0),
                    eos_id=0, pad_id=0)
