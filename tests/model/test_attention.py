"""kernels.attention_reference against a float64 numpy softmax attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import kernels

# One compile per case instead of one per primitive (compiles dominate on a small CPU).
attention_jit = jax.jit(kernels.attention_reference, static_argnames=("causal", "scale"))


def np_attention(q, k, v, *, causal=False, mask=None, scale=None):
  """float64 softmax attention written per (batch, query head): q [b,l,h,d], k/v [b,s,g,d];
  query head j reads key/value head j // (h // g); mask [b|1, 1|h, l, s], True = attend;
  causal: query i (the last l of s positions) sees keys j <= i + s - l."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, l, h, d = q.shape
  s, g = k.shape[1], k.shape[2]
  scale = d ** -0.5 if scale is None else scale
  out = np.zeros((b, l, h, d))
  for bi in range(b):
    for hi in range(h):
      gi = hi // (h // g)
      sc = q[bi, :, hi] @ k[bi, :, gi].T * scale  # [l, s]
      allowed = np.ones((l, s), bool)
      if causal:
        allowed &= np.arange(s)[None, :] <= np.arange(l)[:, None] + (s - l)
      if mask is not None:
        m = np.asarray(mask)
        allowed &= m[bi if m.shape[0] > 1 else 0, hi if m.shape[1] > 1 else 0]
      sc = np.where(allowed, sc, -np.inf)
      p = np.exp(sc - sc.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      out[bi, :, hi] = p @ v[bi, :, gi]
  return out


def rand_qkv(seed, b=2, l=5, s=5, h=4, g=4, d=8, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, l, h, d)).astype(np.float32)
  k = rng.normal(size=(b, s, g, d)).astype(np.float32)
  v = rng.normal(size=(b, s, g, d)).astype(np.float32)
  return rng, *(jnp.asarray(x, dtype) for x in (q, k, v))


def random_mask(rng, shape):
  m = rng.random(shape) < 0.6
  m[..., 0] = True  # every query sees at least one key
  return m


CASES = [
    # name, (l, s, h, g), causal, mask kind
    ("bidirectional", (5, 5, 4, 4), False, None),
    ("bidirectional_l_ne_s", (3, 6, 4, 4), False, None),
    ("causal", (6, 6, 4, 4), True, None),
    ("causal_kv_prefix", (3, 7, 4, 4), True, None),
    ("mask_shared_heads", (4, 6, 4, 4), False, "b1"),
    ("mask_per_head", (4, 6, 4, 4), False, "bh"),
    ("mask_and_causal_prefix", (4, 6, 4, 4), True, "b1"),
    ("gqa", (5, 5, 6, 2), False, None),
    ("gqa_causal_prefix", (3, 5, 4, 2), True, None),
    ("gqa_mask_per_head", (4, 6, 6, 3), False, "bh"),
    ("mqa", (4, 4, 4, 1), True, None),
]


def _case(seed, dims, causal, mask_kind, dtype):
  l, s, h, g = dims
  rng, q, k, v = rand_qkv(seed, l=l, s=s, h=h, g=g, dtype=dtype)
  mask = None
  if mask_kind == "b1":
    mask = random_mask(rng, (q.shape[0], 1, l, s))
  elif mask_kind == "bh":
    mask = random_mask(rng, (q.shape[0], h, l, s))
  return q, k, v, mask


@pytest.mark.parametrize("name,dims,causal,mask_kind", CASES, ids=[c[0] for c in CASES])
def test_attention_reference_float32(name, dims, causal, mask_kind):
  q, k, v, mask = _case(len(name), dims, causal, mask_kind, jnp.float32)
  got = attention_jit(q, k, v, causal=causal, mask=None if mask is None else jnp.asarray(mask))
  assert got.shape == q.shape and got.dtype == jnp.float32
  ref = np_attention(q, k, v, causal=causal, mask=mask)
  np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,dims,causal,mask_kind", [CASES[3], CASES[6], CASES[9]],
                         ids=[CASES[i][0] for i in (3, 6, 9)])
def test_attention_reference_bfloat16(name, dims, causal, mask_kind):
  q, k, v, mask = _case(len(name) + 100, dims, causal, mask_kind, jnp.bfloat16)
  got = attention_jit(q, k, v, causal=causal, mask=None if mask is None else jnp.asarray(mask))
  assert got.dtype == jnp.bfloat16
  ref = np_attention(np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32),
                     causal=causal, mask=mask)
  np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2e-2, atol=2e-2)


def test_attention_explicit_scale_and_batch_broadcast_mask():
  rng, q, k, v = rand_qkv(7, l=4, s=5)
  mask = random_mask(rng, (1, 1, 4, 5))
  got = attention_jit(q, k, v, mask=jnp.asarray(mask), scale=0.37)
  ref = np_attention(q, k, v, mask=np.broadcast_to(mask, (2, 1, 4, 5)), scale=0.37)
  np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=1e-5, atol=1e-5)


def test_gqa_heads_must_divide():
  _, q, k, v = rand_qkv(9, h=4, g=3)
  with pytest.raises(ValueError):
    kernels.attention_reference(q, k, v)


def _jnp_attention64(q, k, v, causal):
  """Straightforward jnp attention (x64), GQA by repeating k/v heads."""
  h, g, l, s = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
  k = jnp.repeat(k, h // g, axis=2)
  v = jnp.repeat(v, h // g, axis=2)
  sc = jnp.einsum("blhd,bshd->bhls", q, k) / jnp.sqrt(q.shape[-1])
  if causal:
    sc = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(l)[:, None] + (s - l), sc, -jnp.inf)
  return jnp.einsum("bhls,bshd->blhd", jax.nn.softmax(sc, axis=-1), v)


def test_attention_gradients():
  """jax.grad of a random projection of the output vs (a) jax.grad of a plain float64 jnp
  implementation and (b) a float64 numpy central finite difference along random directions."""
  rng, q, k, v = rand_qkv(10, l=3, s=5, h=4, g=2)
  r = rng.normal(size=q.shape)

  def loss(q, k, v):
    return jnp.sum(kernels.attention_reference(q, k, v, causal=True) * jnp.asarray(r, jnp.float32))

  grads = [np.asarray(x, np.float64) for x in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)]
  with jax.enable_x64(True):
    q64, k64, v64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v))
    ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(_jnp_attention64(q, k, v, True) * jnp.asarray(r)),
                           argnums=(0, 1, 2)))(q64, k64, v64)
    ref = [np.asarray(x) for x in ref]
  for gr, rf in zip(grads, ref):
    assert rf.dtype == np.float64
    np.testing.assert_allclose(gr, rf, rtol=1e-4, atol=1e-5)
    assert np.abs(rf).max() > 1e-2
  # Finite differences, independent of autodiff.
  base = [np.asarray(x, np.float64) for x in (q, k, v)]
  f = lambda xs: float(np.sum(np_attention(*xs, causal=True) * r))
  eps = 1e-5
  for i in range(3):
    for _ in range(2):
      dirn = rng.normal(size=base[i].shape)
      plus = [x.copy() for x in base]
      minus = [x.copy() for x in base]
      plus[i] += eps * dirn
      minus[i] -= eps * dirn
      fd = (f(plus) - f(minus)) / (2 * eps)
      assert float(np.sum(grads[i] * dirn)) == pytest.approx(fd, rel=1e-4, abs=1e-4)


def test_attention_gradient_ignores_masked_keys():
  _, q, k, v = rand_qkv(11, l=4, s=4)
  gv = jax.jit(jax.grad(lambda v: jnp.sum(kernels.attention_reference(q, k, v, causal=True)[:, 0])))(v)
  # Query 0 sees only key 0 (l == s): no gradient reaches later values.
  assert np.all(np.asarray(gv)[:, 1:] == 0.0)
  assert np.abs(np.asarray(gv)[:, 0]).min() > 0


def test_dispatch():
  _, q, k, v = rand_qkv(12)
  assert "xla" in kernels.IMPLEMENTATIONS
  dispatched = jax.jit(kernels.attention, static_argnames=("causal", "implementation"))
  np.testing.assert_array_equal(np.asarray(dispatched(q, k, v, causal=True, implementation="xla")),
                                np.asarray(attention_jit(q, k, v, causal=True)))
  with pytest.raises(ValueError, match="unknown attention implementation"):
    kernels.attention(q, k, v, implementation="does-not-exist")
