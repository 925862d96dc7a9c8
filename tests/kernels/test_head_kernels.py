"""The fused confidence head against log-softmax + Gumbel-max on materialised logits, same noise bits.

Tokens must be equal; probabilities agree to 2e-6 (float32, only the order of
the softmax sums differs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import kernels
from mdlm_jax.kernels import HeadBlockSizes, HeadInput, HeadSettings
from mdlm_jax.sampling import rule
from mdlm_jax.sampling.gumbel import gumbel_argmax


def rand_head(seed, b=2, t=5, d=16, v=50):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)) / 2, jnp.float32)
  bits = jax.random.bits(jax.random.key(seed), (b, t, v), jnp.uint32)
  return hidden, w, bits


def materialised(hidden, w, bits, temperature, exclude_ids):
  logits = jnp.einsum("btd,dv->btv", hidden, w).at[..., list(exclude_ids)].set(-1e9)
  logp = jax.nn.log_softmax(logits, axis=-1)
  if temperature > 0:
    tok = gumbel_argmax(logits, jnp.stack([bits, bits]), temperature, float64=False)
  else:
    tok = jnp.argmax(logits, axis=-1)
  return tok, jnp.exp(jnp.take_along_axis(logp, tok[..., None], -1)[..., 0]), jnp.exp(logp.max(-1))


@pytest.mark.parametrize("backend,temperature", [("gpu", 0.8), ("gpu", 0.0), ("tpu", 1.0)])
def test_fused_head_equals_materialised_logits(backend, temperature):
  seed = int(np.random.SeedSequence().entropy % 2**31)
  hidden, w, bits = rand_head(seed)
  # Excluded: the id 3 and the greedy picks of three positions, ids that would win somewhere.
  favourites = np.asarray(jnp.argmax(jnp.einsum("btd,dv->btv", hidden, w), -1)).ravel()
  excluded = tuple(sorted({3, *np.random.default_rng(seed).choice(favourites, 3).tolist()}))
  st = HeadSettings(temperature, excluded)
  got = jax.jit(lambda h, w, bits: kernels.confidence_head_pallas(
      h, w, bits, st, block_sizes=HeadBlockSizes(16, 16), backend=backend, interpret=True))(hidden, w, bits)
  want = materialised(hidden, w, bits, temperature, excluded)
  ref = kernels.confidence_head_reference(hidden, w, bits, st)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]), err_msg=f"seed {seed}")
  np.testing.assert_array_equal(np.asarray(ref[0]), np.asarray(want[0]), err_msg=f"seed {seed}")
  for a, e in zip(got[1:], want[1:]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-6, atol=2e-6, err_msg=f"seed {seed}")
  assert not np.isin(np.asarray(got[0]), excluded).any()


def test_head_dispatch_on_cpu_is_the_reference():
  hidden, w, bits = rand_head(1)
  ref = kernels.confidence_head_reference(hidden, w, bits, HeadSettings(1.0, (0,)))
  for impl in ("xla", "pallas", "triton"):  # no kernel runs natively on CPU; jax_triton is never imported
    got = kernels.confidence_head(hidden, w, bits, HeadSettings(1.0, (0,)), implementation=impl)
    for a, e in zip(got, ref):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  with pytest.raises(ValueError, match="unknown confidence head implementation"):
    kernels.confidence_head(hidden, w, bits, implementation="cuda")


def test_propose_with_head_input_on_cpu_is_the_logits_path():
  """Where no kernel runs, the samplers' fused-head path materialises the logits: same samples, bit for bit."""
  hidden, w, _ = rand_head(2)
  keys, cols = rule.row_keys(3 + jnp.arange(hidden.shape[0])), jnp.arange(hidden.shape[1])
  for impl in ("xla", "pallas"):
    a = rule.propose(HeadInput(hidden, w, impl), keys, cols, (0,), 0.9)
    b = rule.propose(HeadInput(hidden, w).logits(), keys, cols, (0,), 0.9)
    for x, y in zip(a, b):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_propose_with_an_interpreted_fused_head():
  """The kernel path of `rule.propose`: the float32 Gumbel-max of the same row- and column-keyed bits."""
  hidden, w, _ = rand_head(4)
  keys, cols = rule.row_keys(5 + jnp.arange(hidden.shape[0])), jnp.arange(hidden.shape[1]) + 7
  x0, conf = jax.jit(lambda h: rule.propose(HeadInput(h, w, "pallas_interpret"), keys, cols, (0,), 0.9))(hidden)
  bits = rule.noise_words(keys, cols, w.shape[1])[0]
  want = materialised(hidden, w, bits, 0.9, (0,))
  np.testing.assert_array_equal(np.asarray(x0), np.asarray(want[0]))
  np.testing.assert_allclose(np.asarray(conf), np.asarray(want[1]), rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
def test_triton_head_on_gpu():
  if kernels.kernel_backend() != "gpu":
    pytest.skip("needs a CUDA GPU")
  pytest.importorskip("jax_triton")
  hidden, w, bits = rand_head(6, b=4, t=33, d=64, v=1000)
  for impl in ("triton", "pallas"):
    got = jax.jit(lambda h, w, bits: kernels.confidence_head(h, w, bits, HeadSettings(0.8, (0, 5)),
                                                             implementation=impl))(hidden, w, bits)
    want = kernels.confidence_head_reference(hidden, w, bits, HeadSettings(0.8, (0, 5)))
    assert (np.asarray(got[0]) == np.asarray(want[0])).mean() > 0.99  # TF32 matmuls may flip near-ties
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
def test_flash_attention_compiles_on_gpu():
  if kernels.kernel_backend() != "gpu":
    pytest.skip("needs a CUDA GPU")
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 256, 4, 64)), jnp.bfloat16) for _ in range(3))
  mask = kernels.AttentionMask(kind="causal")
  got = jax.jit(lambda q, k, v: kernels.attention(q, k, v, mask=mask, implementation="pallas"))(q, k, v)
  ref = kernels.attention_reference(q, k, v, mask=mask)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)
