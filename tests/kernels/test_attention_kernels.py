"""Flash attention (Pallas, interpret mode on CPU) against the reference, for every mask kind.

Inputs are fresh random draws each run; the seed is in every failure message.
Tolerances: float32 outputs 2e-5 and gradients 1e-4 (absolute and relative;
observed ~1e-6: only the summation order differs); bfloat16 outputs 3e-2 and
gradients 5e-2 of the largest gradient entry (both sides round p and the
products to bf16, at different points of the computation).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import kernels
from mdlm_jax.diffusion import bd3
from mdlm_jax.kernels import AttentionMask, BlockSizes
from mdlm_jax.kernels.masks import kv_tile_range, q_tile_range

# Small tiles so a few dozen positions span several tiles and a ragged last one.
SMALL = BlockSizes(16, 16, 16, 16, 16, 16)


def fresh_seed() -> int:
  return int(np.random.SeedSequence().entropy % 2**31)


def make_mask(kind, rng, b, l, s):
  if kind == "full":
    return AttentionMask()
  if kind == "causal":
    return AttentionMask(kind="causal")
  if kind in ("block_diffusion", "block_diffusion_causal"):
    return AttentionMask(kind=kind, block_size=4)
  if kind == "prefix":  # a KV cache: each query reads slots < q_end that are valid
    valid = rng.random((b, s)) < 0.8
    q_end = rng.integers(1, s + 1, size=(b, l))
    return AttentionMask(kind="prefix", q_end=jnp.asarray(q_end, jnp.int32), kv_valid=jnp.asarray(valid))
  if kind == "segments":  # packed sequences, right padding
    q_seg = np.sort(rng.integers(0, 3, size=(b, l)), axis=1)
    valid = np.arange(s)[None, :] < s - rng.integers(0, 4, size=(b, 1))
    return AttentionMask(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(q_seg),
                         kv_valid=jnp.asarray(valid))
  raise ValueError(kind)


def rand_inputs(rng, b, l, s, h, g, d, dtype):
  q, k, v = (jnp.asarray(rng.normal(size=shape), dtype) for shape in ((b, l, h, d), (b, s, g, d), (b, s, g, d)))
  return q, k, v, jnp.asarray(rng.normal(size=(b, l, h, d)), jnp.float32)


def compare(kind, dims, dtype, backend="gpu", blocks=SMALL, impl=None):
  """Forward and jax.grad of sum(out * r) against the reference; rows that may
  read no key (allowed to differ) are left out of both. `impl(q, k, v, mask)`:
  the attention under test (default: the Pallas kernel, interpreted)."""
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  b, l, s, h, g, d = dims
  q, k, v, r = rand_inputs(rng, b, l, s, h, g, d, dtype)
  mask = make_mask(kind, rng, b, l, s)
  has_key = np.asarray(jnp.broadcast_to(mask.dense(l, s), (b, 1, l, s))).any(-1)[:, 0]  # [b, l]
  r = r * jnp.asarray(has_key, jnp.float32)[:, :, None, None]

  def run(fn):
    def loss(q, k, v):
      out = fn(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * r), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads

  impl = impl or (lambda *a: kernels.flash_attention(*a, block_sizes=blocks, backend=backend, interpret=True))
  got = jax.jit(lambda q, k, v: run(lambda *a: impl(*a, mask)))(q, k, v)
  ref = jax.jit(lambda q, k, v: run(lambda *a: kernels.attention_reference(*a, mask=mask)))(q, k, v)
  f32 = dtype == jnp.float32
  out, ref_out = (np.asarray(x[0], np.float32) * has_key[:, :, None, None] for x in (got, ref))
  assert got[0].dtype == dtype
  tol = 2e-5 if f32 else 3e-2
  np.testing.assert_allclose(out, ref_out, rtol=tol, atol=tol, err_msg=f"output, seed {seed}")
  for name, a, e in zip("qkv", got[1], ref[1]):
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    assert a.dtype == e.dtype and np.isfinite(a).all()
    if f32:
      np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4, err_msg=f"d{name}, seed {seed}")
    else:
      assert np.abs(a - e).max() <= 5e-2 * np.abs(e).max(), f"d{name}, seed {seed}"
  return out


# (b, l, s, h, g, d): lengths not divisible by the 16-wide tiles; GQA where g < h.
CASES = [
    ("full", (2, 20, 20, 2, 2, 8)),
    ("causal", (1, 12, 37, 4, 2, 8)),  # queries are the last 12 of 37 keys (a KV-cache prefix)
    ("block_diffusion", (1, 24, 24, 2, 1, 8)),  # [x_t ; x_0], L = 12, blocks of 4
    ("block_diffusion_causal", (1, 24, 24, 2, 1, 8)),  # the same with a token-causal clean half
    ("prefix", (2, 9, 40, 2, 2, 8)),
    ("segments", (2, 30, 30, 4, 2, 8)),
]


# The default run keeps to a few compiles; the sweep (-m slow) runs every case
# on both variants in both dtypes. "segments" is a full mask plus per-row
# arrays; "prefix" runs by default on the TPU variant.
DEFAULT = [CASES[i] for i in (1, 2, 4)]


@pytest.mark.parametrize("kind,dims", DEFAULT, ids=[c[0] for c in DEFAULT])
def test_flash_float32(kind, dims):
  compare(kind, dims, jnp.float32)


@pytest.mark.slow
def test_flash_bfloat16():
  compare("block_diffusion", (1, 24, 24, 2, 2, 16), jnp.bfloat16)


def test_flash_tpu_variant():
  """The Mosaic variant (grid over key tiles, scratch accumulators) in interpret mode."""
  compare("prefix", (2, 20, 33, 2, 1, 8), jnp.float32, backend="tpu")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("kind,dims", CASES + [("causal", (2, 33, 33, 2, 2, 16)),
                                               ("block_diffusion", (2, 64, 64, 4, 2, 16))])
def test_flash_sweep(kind, dims, dtype, backend):
  compare(kind, dims, dtype, backend=backend, blocks=BlockSizes(16, 32, 32, 16, 16, 32))


def test_rows_reading_nothing_are_zero():
  _, k, v, _ = rand_inputs(np.random.default_rng(0), 1, 3, 5, 2, 2, 8, jnp.float32)
  q = k[:, :3]
  mask = AttentionMask(kind="prefix", q_end=jnp.asarray([[0, 2, 5]], jnp.int32), kv_valid=jnp.ones((1, 5), bool))
  out = jax.jit(lambda q: kernels.flash_attention(q, k, v, mask, interpret=True))(q)
  assert np.all(np.asarray(out)[0, 0] == 0.0) and np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("kind", ["causal", "block_diffusion", "block_diffusion_causal"])
def test_tile_ranges_cover_every_allowed_tile(kind):
  """The loops' structural ranges are supersets of the tiles holding an allowed entry."""
  for l, s, bs in [(24, 24, 4), (12, 37, 1), (16, 16, 8)]:
    if kind.startswith("block") and l != s:
      continue
    mask = AttentionMask(kind=kind, block_size=bs if kind.startswith("block") else 0)
    dense = np.asarray(mask.dense(l, s))[0, 0]
    for bq, bk in [(4, 8), (8, 4), (16, 16)]:
      nq, nk = -(-l // bq), -(-s // bk)
      tiles = np.zeros((nq, nk), bool)
      for i in range(nq):
        for j in range(nk):
          tiles[i, j] = dense[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
      for i in range(nq):
        lo, hi = (int(x) for x in kv_tile_range(mask.spec, i * bq, (i + 1) * bq, l=l, s=s, block_k=bk,
                                                   num_k_blocks=nk))
        assert not tiles[i, :lo].any() and not tiles[i, hi:].any(), (l, s, bq, bk, i)
      for j in range(nk):
        lo, hi = (int(x) for x in q_tile_range(mask.spec, j * bk, (j + 1) * bk, l=l, s=s, block_q=bq,
                                                  num_q_blocks=nq))
        assert not tiles[:lo, j].any() and not tiles[hi:, j].any(), (l, s, bq, bk, j)


@pytest.mark.parametrize("clean_causal", [False, True])
def test_block_diffusion_mask_equals_training_mask(clean_causal):
  kind = "block_diffusion_causal" if clean_causal else "block_diffusion"
  for l, bs in [(8, 2), (12, 4), (6, 6)]:
    dense = np.asarray(AttentionMask(kind=kind, block_size=bs).dense(2 * l, 2 * l))[0, 0]
    np.testing.assert_array_equal(dense, bd3.block_attention_mask(l, bs, clean_causal=clean_causal))


def test_mask_validation():
  with pytest.raises(ValueError, match="unknown mask kind"):
    AttentionMask(kind="diagonal")
  with pytest.raises(ValueError, match="q_end"):
    AttentionMask(kind="prefix")
  with pytest.raises(ValueError, match="block_size"):
    AttentionMask(kind="block_diffusion")
  with pytest.raises(ValueError, match="causal=True cannot be combined"):
    AttentionMask(kind="block_diffusion", block_size=2).with_causal(True)
  with pytest.raises(ValueError, match="block_diffusion needs"):
    AttentionMask(kind="block_diffusion", block_size=3).check(8, 8)
  _, q, k, v = (None, *rand_inputs(np.random.default_rng(1), 1, 4, 4, 2, 2, 8, jnp.float32)[:3])
  with pytest.raises(ValueError, match="backend"):
    kernels.flash_attention(q, k, v, backend="cpu")


def test_dispatch_falls_back_to_the_reference():
  """On CPU "pallas" is the reference bit for bit; a dense boolean mask has no
  structure for a kernel, so even "pallas_interpret" runs the reference for it."""
  rng = np.random.default_rng(fresh_seed())
  q, k, v, _ = rand_inputs(rng, 2, 6, 6, 2, 2, 8, jnp.float32)
  dense = jnp.asarray(rng.random((2, 1, 6, 6)) < 0.7).at[..., 0].set(True)
  ref = jax.jit(lambda q, k, v: kernels.attention_reference(q, k, v, causal=True))(q, k, v)
  for impl in ("xla", "pallas"):
    got = jax.jit(lambda q, k, v: kernels.attention(q, k, v, causal=True, implementation=impl))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  ref = jax.jit(lambda q, k, v: kernels.attention_reference(q, k, v, mask=dense))(q, k, v)
  got = jax.jit(lambda q, k, v: kernels.attention(q, k, v, mask=dense, implementation="pallas_interpret"))(q, k, v)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.slow
def test_dispatch_under_a_mesh_runs_per_shard():
  """shard_map over the mesh's batch (data) and head (tensor) axes, 4 CPU devices."""
  from mdlm_jax.parallel import sharding
  import ml_collections
  mesh = sharding.make_mesh(ml_collections.ConfigDict({"data": 2, "fsdp": 1, "tensor": 2}))
  rng = np.random.default_rng(fresh_seed())
  q, k, v, _ = rand_inputs(rng, 2, 20, 20, 4, 2, 8, jnp.float32)
  mask = make_mask("segments", rng, 2, 20, 20)
  attend = jax.jit(lambda q, k, v, m: kernels.attention(q, k, v, mask=m, implementation="pallas_interpret",
                                                         block_sizes=SMALL))
  with jax.set_mesh(mesh):
    got = attend(q, k, v, mask)
  ref = kernels.attention_reference(q, k, v, mask=mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
