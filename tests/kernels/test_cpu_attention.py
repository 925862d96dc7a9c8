"""The CPU decoding attention (`kernels/cache_attention.cc`) against a float64
numpy softmax attention, on fresh random shapes, masks and values; and which
`cache_attention` calls it serves."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import kernels
from mdlm_jax.kernels import cpu_attention
from tests.kernels.conftest import BUILDS_GROUP

pytestmark = pytest.mark.skipif(not kernels.native_kernel_ready(), reason="no C++ compiler on this machine")


@pytest.fixture
def vector_paths(monkeypatch):
  """Which calls the kernel serves, as on a CPU it has its vector paths for (a build without them runs the
  same values through its portable loop, which serves nothing by default)."""
  monkeypatch.setattr(kernels.int8, "attention_ready", lambda: True)


def fresh_rng():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  return np.random.default_rng(seed), seed


def numpy_attention(q, keys, values, layer, q_end, kv_valid):
  """float64 softmax attention of q [b, l, h, d] over the cache buffers'
  layer (keys [n, B, g, d, s], values [n, B, g, s, d]); zeros where a query
  may read nothing."""
  b, l, h, d = q.shape
  g, s = keys.shape[2], keys.shape[-1]
  out = np.zeros((b, l, h, d))
  for row in range(b):
    for i in range(l):
      allowed = kv_valid[row] & (np.arange(s) < q_end[row, i])
      if not allowed.any():
        continue
      for head in range(h):
        group = head // (h // g)
        k = keys[layer, row, group].astype(np.float64)  # [d, s]
        v = values[layer, row, group].astype(np.float64)  # [s, d]
        scores = q[row, i, head].astype(np.float64) @ k / np.sqrt(d)
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max())
        out[row, i, head] = (p / p.sum()) @ v
  return out


def random_case(rng, d: int | None = None):
  """A random attention over a cache; head dimension `d` (None: random, 3 to 96)."""
  n, g, r = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
  d = int(rng.integers(3, 97)) if d is None else d
  b, l, s = int(rng.integers(1, 4)), int(rng.integers(1, 20)), int(rng.integers(1, 700))
  rows = b + int(rng.integers(0, 2))  # the buffer may hold more rows than the queries read
  q = rng.normal(size=(b, l, g * r, d)).astype(np.float32) * 2
  keys = rng.normal(size=(n, rows, g, d, s)).astype(np.float32)
  values = rng.normal(size=(n, rows, g, s, d)).astype(np.float32)
  q_end = rng.integers(0, s + 3, size=(b, l)).astype(np.int32)  # 0: nothing to read; past s: clamped
  kv_valid = rng.random((b, s)) < rng.uniform(0.3, 1)
  return q, keys, values, int(rng.integers(0, n)), q_end, kv_valid


def test_the_kernel_equals_a_float64_softmax_attention_on_random_masks():
  # half the cases with a head dimension of whole 16-lane registers, which the
  # values' sums hold in registers (up to 128), one past that
  for d in (None, None, None, 16, 64, 128, 144):
    rng, seed = fresh_rng()
    q, keys, values, layer, q_end, kv_valid = random_case(rng, d)
    mask = kernels.AttentionMask(kind="prefix", q_end=jnp.asarray(q_end), kv_valid=jnp.asarray(kv_valid))
    got = jax.jit(cpu_attention.cpu_cache_attention, static_argnums=3)(
        jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), layer, mask)
    want = numpy_attention(q, keys, values, layer, q_end, kv_valid)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")


@BUILDS_GROUP
@pytest.mark.slow  # a second kernel build and 9 s
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma")],
                         ids=["no-avx512", "no-avx2"])
def test_the_kernel_built_without_its_widest_vectors_computes_the_same(flags, kernels_built_with):
  lib = ctypes.cdll.LoadLibrary(kernels_built_with(flags))
  target = "test_cache_attention" + "".join(flags).replace("-", "_")  # one registration a build
  jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.CacheAttention), platform="cpu")
  rng, seed = fresh_rng()
  q, keys, values, layer, q_end, kv_valid = random_case(rng)
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  got = jax.ffi.ffi_call(target, out)(
      jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(q_end), jnp.asarray(kv_valid),
      layer=np.int64(layer), scale=np.float32(q.shape[-1] ** -0.5))
  want = numpy_attention(q, keys, values, layer, q_end, kv_valid)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")


def test_cache_attention_serves_a_decoding_pass_with_the_kernel_and_the_same_values(monkeypatch, vector_paths):
  """Through `cache_attention` as the model calls it (every layer's buffer,
  a prefix mask): the kernel's values equal XLA's path's, and the kernel is
  what ran (its answer for a query that reads nothing is zeros, XLA's the
  mean of the values)."""
  rng, seed = fresh_rng()
  q, keys, values, layer, q_end, kv_valid = random_case(rng)
  q_end[0, 0] = 0
  mask = kernels.AttentionMask(kind="prefix", q_end=jnp.asarray(q_end), kv_valid=jnp.asarray(kv_valid))
  args = (jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values))
  assert cpu_attention.serves(*args, layer, mask, "xla")
  run = jax.jit(lambda q, k, v, mask: kernels.cache_attention(q, k, v, layer=layer, mask=mask))
  got = np.asarray(run(*args, mask))
  with monkeypatch.context() as m:
    m.setattr(cpu_attention, "serves", lambda *a: False)
    xla = np.asarray(jax.jit(lambda q, k, v, mask: kernels.cache_attention(q, k, v, layer=layer, mask=mask))(
        *args, mask))
  reads = (kv_valid[:, None, :] & (np.arange(kv_valid.shape[1]) < q_end[..., None])).any(-1)  # [b, l]
  np.testing.assert_allclose(got[reads], xla[reads], rtol=1e-4, atol=1e-5, err_msg=f"seed {seed}")
  np.testing.assert_array_equal(got[0, 0], 0.0)


def test_the_kernel_path_differentiates_as_a_float64_attention(vector_paths):
  """Training through a cache differentiates the kernel's call: its
  derivatives (XLA's, a query that reads nothing having none) against float64
  central differences of the numpy attention along a random direction."""
  rng, seed = fresh_rng()
  q, keys, values, layer, q_end, kv_valid = random_case(rng)
  q_end[-1, -1], kv_valid[-1, 0] = keys.shape[-1], True  # one query reads something
  if q_end.size > 1:
    q_end[0, 0] = 0  # and, where there are two, one reads nothing
  mask = kernels.AttentionMask(kind="prefix", q_end=jnp.asarray(q_end), kv_valid=jnp.asarray(kv_valid))
  args = tuple(jnp.asarray(x) for x in (q, keys, values))
  assert cpu_attention.serves(*args, layer, mask, "xla")
  weights = rng.normal(size=q.shape)
  loss = lambda q, k, v: jnp.sum(kernels.cache_attention(q, k, v, layer=layer, mask=mask) * weights)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  direction = [rng.normal(size=x.shape) for x in (q, keys, values)]
  predicted = sum(np.sum(np.asarray(g, np.float64) * d) for g, d in zip(grads, direction))

  def at(eps):
    moved = [x.astype(np.float64) + eps * d for x, d in zip((q, keys, values), direction)]
    return np.sum(numpy_attention(*moved, layer, q_end, kv_valid) * weights)

  eps = 1e-3
  expected = (at(eps) - at(-eps)) / (2 * eps)
  scale = sum(np.sum(np.abs(np.asarray(g, np.float64) * d)) for g, d in zip(grads, direction))
  assert abs(predicted - expected) <= 1e-4 * abs(expected) + 1e-7 * scale, f"seed {seed}: {predicted} vs {expected}"
  if q_end.size > 1:
    assert not np.asarray(grads[0])[0, 0].any()  # the query that reads nothing


def test_the_kernel_serves_only_float32_prefix_masks_of_few_queries_on_cpu(monkeypatch, vector_paths):
  q, k, v = jnp.zeros((1, 4, 2, 8)), jnp.zeros((2, 1, 1, 8, 16)), jnp.zeros((2, 1, 1, 16, 8))
  prefix = kernels.AttentionMask(kind="prefix", q_end=jnp.ones((1, 4), jnp.int32), kv_valid=jnp.ones((1, 16), bool))
  assert cpu_attention.serves(q, k, v, 1, prefix, "xla")
  assert not cpu_attention.serves(q, k, v, None, prefix, "xla")  # one layer's buffer, not every layer's
  assert not cpu_attention.serves(q, k, v, 1, kernels.AttentionMask(kind="causal"), "xla")
  assert not cpu_attention.serves(q, k, v, 1, prefix, "reference")
  assert not cpu_attention.serves(q.astype(jnp.bfloat16), k, v, 1, prefix, "xla")
  many = jnp.zeros((1, cpu_attention.MAX_QUERIES + 1, 2, 8))
  assert not cpu_attention.serves(many, k, v, 1, prefix.replace(q_end=jnp.ones((1, many.shape[1]), jnp.int32)),
                                  "xla")
  monkeypatch.setattr(kernels.int8, "attention_ready", lambda: False)  # a build without its vector paths
  assert not cpu_attention.serves(q, k, v, 1, prefix, "xla")


def test_a_query_reads_the_same_bits_wherever_its_slots_sit():
  """The same keys and values at slot 0 (the engine's prompt) or after padding
  (the AR path's left-padded prompt), at every offset modulo 16: the outputs are
  equal bits, as int8 decoding needs of the AR step and the revising pass."""
  rng, seed = fresh_rng()
  d, g, r, used = 64, 3, 3, int(rng.integers(20, 300))
  keys = rng.normal(size=(used, g, d)).astype(np.float32)
  values = rng.normal(size=(used, g, d)).astype(np.float32)
  q = (rng.normal(size=(1, 5, g * r, d)) * 2).astype(np.float32)
  outs = []
  for pad in range(17):
    s = pad + used + 7
    kb = np.zeros((1, 1, g, d, s), np.float32)
    vb = np.zeros((1, 1, g, s, d), np.float32)
    kb[0, 0, :, :, pad:pad + used] = keys.transpose(1, 2, 0)
    vb[0, 0, :, pad:pad + used] = values.transpose(1, 0, 2)
    valid = np.zeros((1, s), bool)
    valid[0, pad:pad + used] = True
    q_end = (pad + used - 4 + np.arange(5, dtype=np.int32))[None]  # the last queries read every slot
    outs.append(np.asarray(cpu_attention.cpu_cache_attention(jnp.asarray(q), jnp.asarray(kb), jnp.asarray(vb), 0,
                                                             kernels.AttentionMask(kind="prefix", q_end=jnp.asarray(q_end),
                                                                                   kv_valid=jnp.asarray(valid)))))
  for pad, out in enumerate(outs):
    np.testing.assert_array_equal(out, outs[0], err_msg=f"padding {pad}, seed {seed}")


def test_a_query_reads_the_same_bits_beside_any_number_of_others():
  """A query alone (an AR step: one column) or among up to 20 columns of a
  pass (a revising pass's head, scored in blocks of other sizes): its output
  is the same bits, as the revising pass's verification of the AR step needs."""
  rng, seed = fresh_rng()
  d, g, r, s = 64, 3, 3, int(rng.integers(40, 400))
  keys = rng.normal(size=(1, 1, g, d, s)).astype(np.float32)
  values = rng.normal(size=(1, 1, g, s, d)).astype(np.float32)
  valid = rng.random((1, s)) < 0.9
  columns = 20
  q = (rng.normal(size=(1, columns, g * r, d)) * 2).astype(np.float32)
  q_end = np.sort(rng.integers(1, s + 1, size=(1, columns))).astype(np.int32)

  def attend(cols):
    mask = kernels.AttentionMask(kind="prefix", q_end=jnp.asarray(q_end[:, cols]), kv_valid=jnp.asarray(valid))
    return np.asarray(cpu_attention.cpu_cache_attention(jnp.asarray(q[:, cols]), jnp.asarray(keys),
                                                        jnp.asarray(values), 0, mask))

  alone = np.concatenate([attend([i]) for i in range(columns)], axis=1)
  for n in (2, 4, 6, 7, 13, columns):
    np.testing.assert_array_equal(attend(list(range(n))), alone[:, :n], err_msg=f"{n} columns, seed {seed}")
