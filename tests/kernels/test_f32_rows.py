"""The float32 few-row products (`kernels/f32_rows.cc`) against float64 numpy on
fresh random shapes and values; a row's bits whatever rows sit beside it; which
products `out_in_matmul` hands them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import kernels
from mdlm_jax.kernels import f32_rows

pytestmark = pytest.mark.skipif(not kernels.int8.f32_rows_ready(),
                                reason="the CPU kernels do not build vectorized on this machine")


def fresh_rng():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  return np.random.default_rng(seed), seed


def test_the_products_match_float64_numpy():
  rng, seed = fresh_rng()
  for _ in range(4):
    m, k, n = int(rng.integers(1, f32_rows.MAX_ROWS + 1)), int(rng.integers(1, 700)), int(rng.integers(1, 300))
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(n, k)).astype(np.float32)
    got = np.asarray(jax.jit(f32_rows.matmul)(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k), err_msg=f"seed {seed}: {m}x{k}x{n}")


def test_a_row_has_the_same_bits_alone_or_beside_others():
  """What revision needs of an AR step (one row) and a revising pass (several):
  at every row count, with token rows that fit the L1 cache and rows that
  outgrow it, and an odd number of outputs."""
  rng, seed = fresh_rng()
  product = jax.jit(f32_rows.matmul)
  for k in (8 * int(rng.integers(1, 80)) + int(rng.integers(0, 8)), int(rng.integers(1100, 1600))):
    x = rng.normal(size=(f32_rows.MAX_ROWS, k)).astype(np.float32)
    w = rng.normal(size=(97, k)).astype(np.float32)
    alone = np.stack([np.asarray(product(x[r:r + 1], w))[0] for r in range(f32_rows.MAX_ROWS)])
    for m in range(2, f32_rows.MAX_ROWS + 1):
      together = np.asarray(product(x[:m], w))
      np.testing.assert_array_equal(together, alone[:m], err_msg=f"seed {seed}: {m} rows of {k} inputs")


def test_out_in_matmul_hands_it_few_float32_rows_and_differentiates():
  rng, seed = fresh_rng()
  k, n = 24, 40
  w = jnp.asarray(rng.normal(size=(n, k)), jnp.float32)
  few, many = jnp.ones((f32_rows.MAX_ROWS, k)), jnp.ones((f32_rows.MAX_ROWS + 1, k))
  assert f32_rows.serves(few, w) and f32_rows.serves(few[:1], w)
  assert not f32_rows.serves(many, w)
  assert not f32_rows.serves(few.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
  assert not f32_rows.serves(few, w, preferred_element_type=jnp.bfloat16)
  x = jnp.asarray(rng.normal(size=(3, k)), jnp.float32)
  hlo = jax.jit(kernels.out_in_matmul).lower(x, w).as_text()
  assert kernels.int8.F32_ROWS_FFI_TARGET in hlo
  weights = rng.normal(size=(3, n))
  grads = jax.grad(lambda x, w: jnp.sum(kernels.out_in_matmul(x, w) * weights), argnums=(0, 1))(x, w)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  np.testing.assert_allclose(np.asarray(grads[0]), weights @ w64, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")
  np.testing.assert_allclose(np.asarray(grads[1]), weights.T @ x64, rtol=1e-5, atol=1e-5, err_msg=f"seed {seed}")


def test_bench_kernels_times_the_float32_products_at_each_row_count_and_rejects_too_many_rows():
  """`bench kernels --f32-rows`: what a pass of these rows spends in the kernel."""
  from mdlm_jax.bench import kernels as bench_kernels
  out = bench_kernels.time_f32_products([1, 3], repeats=2, layers=2, from_cache=True)
  assert (out["layers"], out["from_cache"]) == (2, True)
  for m in (1, 3):
    row = out[f"rows{m}"]
    assert set(row) == {*bench_kernels.SMOLLM2_LAYER, "head", "pass_ms"}
    for name, (n, k, _) in {**bench_kernels.SMOLLM2_LAYER, "head": (*bench_kernels.SMOLLM2_HEAD, 1)}.items():
      copies = 1 if name == "head" else 2
      assert 0 < row[name]["ms"] <= row[name]["median_ms"]
      assert row[name]["gb_per_s"] == pytest.approx(copies * n * k * 4 / row[name]["ms"] / 1e6)
    assert row["pass_ms"] == pytest.approx(sum(row[name]["ms"] for name in row if name != "pass_ms"))
  in_order = out["in_order"]
  assert set(in_order) == {"rows1", "rows3"}
  for m in (1, 3):
    assert 0 < in_order[f"rows{m}"]["ms"] <= in_order[f"rows{m}"]["median_ms"]
  assert in_order["rows1"]["vs_rows1"] == 1.0
  assert in_order["rows3"]["vs_rows1"] == pytest.approx(in_order["rows3"]["median_ms"] / in_order["rows1"]["median_ms"])
  with pytest.raises(ValueError, match=f"1 to {f32_rows.MAX_ROWS} token rows, got {f32_rows.MAX_ROWS + 1}"):
    bench_kernels.time_f32_products([f32_rows.MAX_ROWS + 1], repeats=1, layers=1)
