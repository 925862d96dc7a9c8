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


@pytest.mark.parametrize("backend,temperature,d", [("gpu", 0.8, 16), ("gpu", 0.0, 16), ("gpu", 0.8, 40),
                                                   ("tpu", 1.0, 16)])
def test_fused_head_equals_materialised_logits(backend, temperature, d):
  """d=40 reads the hidden size in three slices of 16, the last zero-padded."""
  seed = int(np.random.SeedSequence().entropy % 2**31)
  hidden, w, bits = rand_head(seed, d=d)
  # Excluded: the id 3 and the greedy picks of three positions, ids that would win somewhere.
  favourites = np.asarray(jnp.argmax(jnp.einsum("btd,dv->btv", hidden, w), -1)).ravel()
  excluded = tuple(sorted({3, *np.random.default_rng(seed).choice(favourites, 3).tolist()}))
  st = HeadSettings(temperature, excluded)
  got = jax.jit(lambda h, w, bits: kernels.confidence_head_pallas(
      h, w, bits, st, block_sizes=HeadBlockSizes(16, 16, 16), backend=backend, interpret=True))(hidden, w, bits)
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


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_the_triton_head_in_triton_s_interpreter(monkeypatch, temperature):
  """The jax-triton kernel's own launch (sizes as constants, the hidden size in
  slices, a part-filled last vocabulary tile) run by Triton's interpreter
  where Triton is installed; a GPU run needs jax-triton too."""
  monkeypatch.setenv("TRITON_INTERPRET", "1")  # read as Triton is imported
  triton = pytest.importorskip("triton")
  if not triton.knobs.runtime.interpret:
    pytest.skip("Triton was imported before TRITON_INTERPRET was set")
  from kernels import confidence_head_triton as head_triton  # the module jax-triton's path imports
  from tests.kernels.triton_interpreter import HostTensor
  seed = int(np.random.SeedSequence().entropy % 2**31)
  hidden, w, bits = rand_head(seed, b=2, t=9, d=40, v=300)
  st = HeadSettings(temperature, (3, 17))
  inputs, out_shape, grid, constants = head_triton.launch(hidden, w, bits, st, block_sizes=HeadBlockSizes(16, 64, 16))
  outs = [HostTensor(np.zeros(o.shape, o.dtype)) for o in out_shape]
  head_triton._kernel.__wrapped__()[grid](*(HostTensor(np.asarray(x)) for x in inputs), *outs, **constants)  # pylint: disable=protected-access
  want = materialised(hidden, w, bits, temperature, st.exclude_ids)
  np.testing.assert_array_equal(outs[0].array.reshape(2, 9), np.asarray(want[0]), err_msg=f"seed {seed}")
  for got, e in zip(outs[1:], want[1:]):
    np.testing.assert_allclose(got.array.reshape(2, 9), np.asarray(e), rtol=1e-5, atol=1e-6, err_msg=f"seed {seed}")
