"""Weight-only int8 decoding weights: the quantizer, the CPU kernel and XLA's
path against exact integer products of the rounded rows and float64 products
of the dequantized weights, on fresh inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdlm_jax import kernels
from mdlm_jax.kernels import int8
from tests.kernels.conftest import BUILDS_GROUP

ONE = np.int64(0)  # the kernels' `layer` attribute for an operand holding one weight, not a stack


def fresh_rng():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  return np.random.default_rng(seed), seed


def serve_with(kernel: bool, monkeypatch):
  """Products run on the C++ kernel (the test skipped where it cannot be
  built), or with `kernel` False on XLA's path."""
  if kernel and not kernels.native_kernel_ready():
    pytest.skip("no C++ compiler on this machine: the XLA path serves every call")
  if not kernel:
    monkeypatch.setattr(int8, "native_kernel_ready", lambda: False)


def test_quantize_maps_each_rows_largest_magnitude_to_127_and_rounds_the_rest():
  rng, seed = fresh_rng()
  w = rng.normal(size=(6, 5, 40)).astype(np.float32)
  w[2, 1] = 0.0  # an all-zero row keeps a finite scale
  qw = kernels.quantize(jnp.asarray(w), out_dims=2)
  q, scale = np.asarray(qw.q), np.asarray(qw.scale, np.float64)
  assert q.dtype == np.int8 and scale.shape == (6, 5)
  amax = np.abs(w.astype(np.float64)).max(-1)
  np.testing.assert_allclose(scale, np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
  np.testing.assert_array_equal(np.abs(q).max(-1)[amax > 0], 127)
  np.testing.assert_array_equal(q, np.round(w / scale[..., None].astype(np.float32)).astype(np.int8))
  # within half a step of the weight, row by row
  err = np.abs(np.asarray(qw.dequantize(), np.float64) - w)
  assert (err <= scale[..., None] / 2 + 1e-7).all(), f"seed {seed}"


def near_ties(ratio):
  """Where x / scale (float64 `ratio`) lies within a few float32 ulps of a
  half: XLA may divide as a product by the reciprocal, so such a value
  rounds either way, one step of its scale."""
  return np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 4 * 2.0**-24 * np.abs(ratio)


def rows_rounded_to_int16(x):
  """The documented rounding, in numpy: int16 values and one scale per row."""
  amax = np.abs(x).max(1)
  xs = np.where(amax > 0, amax / np.float32(32767), np.float32(1)).astype(np.float32)
  return np.clip(np.round(x / xs[:, None]), -32767, 32767).astype(np.int64), xs


@pytest.mark.parametrize("rows", [1, 2, 3, 9, int8.KERNEL_MAX_ROWS, int8.KERNEL_MAX_ROWS + 5])
def test_int8_matmul_equals_the_exact_integer_product_of_the_rounded_rows(rows):
  rng, seed = fresh_rng()
  # widths that pad the kernel's tiles of 32 output rows and its columns, magnitudes that differ by row
  k, n = int(rng.integers(20, 700)), int(rng.integers(20, 300))
  qw = kernels.quantize(jnp.asarray(rng.normal(size=(n, k)), jnp.float32))
  x = (rng.normal(size=(rows, k)) * rng.uniform(0.01, 100, size=(rows, 1))).astype(np.float32)
  x[0, : k // 3] = 0.0
  got = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw))
  xq, xs = rows_rounded_to_int16(x)
  q, scale = np.asarray(qw.q, np.int64), np.asarray(qw.scale, np.float64)
  want = (xq @ q.T) * xs[:, None].astype(np.float64) * scale[None, :]
  if rows <= int8.KERNEL_MAX_ROWS and kernels.native_kernel_ready():
    # the kernel's integer sum is exact: one rounding to float32 at the end
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"seed {seed}")
  else:  # XLA's float32 sum of the same integer products
    magnitude = (np.abs(xq) @ np.abs(q).T) * xs[:, None].astype(np.float64) * scale[None, :]
    ties = (near_ties(x / xs[:, None].astype(np.float64)) @ np.abs(q).T) * xs[:, None].astype(np.float64) * scale
    assert (np.abs(got - want) <= 1e-5 * magnitude + ties + 1e-30).all(), f"seed {seed}"
  # and within the rounding's bound of the float64 product of the unrounded rows
  wdq = q * scale[:, None]
  exact = x.astype(np.float64) @ wdq.T
  bound = (xs[:, None] / 2) @ np.abs(wdq).sum(1)[None, :] + 2e-6 * np.abs(exact).max()
  assert (np.abs(got - exact) <= bound).all(), f"seed {seed}"


@pytest.mark.parametrize("rows", [1, 6, int8.KERNEL_MAX_ROWS + 3])
@pytest.mark.parametrize("kernel", [True, False])
def test_joined_adapters_add_their_update_to_the_chosen_rows_only(rows, kernel, monkeypatch):
  serve_with(kernel, monkeypatch)
  rng, seed = fresh_rng()
  k, rank, scale = int(rng.integers(20, 300)), int(rng.integers(1, 9)), float(rng.uniform(0.5, 3))
  widths = [int(w) for w in rng.integers(1, 90, size=int(rng.integers(2, 4)))]  # q, k and v; gate and up
  a = [rng.normal(size=(k, rank)).astype(np.float32) for _ in widths]
  b = [rng.normal(size=(rank, w)).astype(np.float32) for w in widths]
  qw = kernels.quantize(jnp.asarray(rng.normal(size=(sum(widths), k)), jnp.float32))
  qw = qw.replace(adapters=kernels.join_adapters(list(zip(a, b)), scale))
  x = rng.normal(size=(rows, k)).astype(np.float32)
  chosen = rng.random(rows) < 0.5
  base = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw.replace(adapters=None)), np.float64)
  delta = np.concatenate([x.astype(np.float64) @ ai @ bi for ai, bi in zip(a, b)], axis=1) * scale
  for adapter_rows, on in ((jnp.asarray(chosen), chosen), (None, np.ones(rows, bool)), (False, np.zeros(rows, bool))):
    got = np.asarray(jax.jit(kernels.int8_matmul, static_argnums=2 if adapter_rows is None or adapter_rows is False
                             else ())(jnp.asarray(x), qw, adapter_rows), np.float64)
    want = base + delta * on[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"seed {seed}")


def test_a_row_of_zeros_and_the_largest_int16_products_do_not_overflow():
  # 8,448 columns of the largest magnitudes: each int32 lane of the kernel's sum
  # (one column pair's two products a step) would pass 2^31 after 258 pairs were
  # it not emptied into int64 totals every 256, and the sum itself is past int32.
  k = 8448
  qw = kernels.QuantizedWeight(jnp.full((3, k), 127, jnp.int8), jnp.ones((3,), jnp.float32))  # tiled per call
  x = np.zeros((2, k), np.float32)
  x[1] = 1.0
  got = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw))
  np.testing.assert_array_equal(got[0], 0.0)
  # exact integer sums in the kernel; XLA's path sums in float32
  np.testing.assert_allclose(got[1], 127.0 * k, rtol=1e-6 if kernels.native_kernel_ready() else 1e-4)


def build_without(flags, kernels_built_with, plain, lora=None):
  """The kernels built with `flags` (`kernels_built_with`), `plain` (and
  `lora`, as name + "_lora") registered under a name of their own, which is
  returned."""
  import ctypes
  lib = ctypes.cdll.LoadLibrary(kernels_built_with(flags))
  name = f"test_{plain}_{lora}_" + flags[0].strip("-").replace("-", "_")
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, plain)), platform="cpu")
  if lora:
    jax.ffi.register_ffi_target(name + "_lora", jax.ffi.pycapsule(getattr(lib, lora)), platform="cpu")
  return name


@BUILDS_GROUP
@pytest.mark.parametrize("flags", [pytest.param(("-mno-avx512vnni",), marks=pytest.mark.slow), ("-mno-avx512f",)],
                         ids=["no-vnni", "no-avx512"])
def test_the_kernel_built_without_vnni_or_avx512_forms_the_same_sums(flags, kernels_built_with):
  """The paths for CPUs without AVX-512 VNNI (a plain integer loop) or
  without AVX-512 (scalar rounding, epilogue and adapters), built and checked
  here: exact integer sums over long rows (each chunk's int32 sum stays below
  2^31), and adapters on chosen rows."""
  name = build_without(flags, kernels_built_with, "Int8Matmul", "Int8LoraMatmul")
  rng, seed = fresh_rng()
  k, n, rows = int(rng.integers(2000, 9000)), int(rng.integers(3, 70)), int(rng.integers(1, 12))
  q = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
  q[0] = 127
  scale = rng.uniform(0.5, 2, size=n).astype(np.float32)
  x = rng.normal(size=(rows, k)).astype(np.float32)
  x[0] = np.abs(x[0])  # with row 0 of q, a sum of the largest products
  out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
  tiles = kernels.tile_weights(jnp.asarray(q))
  got = np.asarray(jax.ffi.ffi_call(name, out)(jnp.asarray(x), tiles, jnp.asarray(scale), layer=ONE))
  xq, xs = rows_rounded_to_int16(x)
  want = (xq @ q.astype(np.int64).T) * xs[:, None].astype(np.float64) * scale.astype(np.float64)[None, :]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"seed {seed}")
  # two adapters splitting the outputs at a random row, on a random choice of token rows
  rank, cut = int(rng.integers(1, 9)), int(rng.integers(1, n)) if n > 1 else 1
  a = [rng.normal(size=(k, rank)).astype(np.float32) / np.sqrt(k) for _ in range(2)]
  b = [rng.normal(size=(rank, w)).astype(np.float32) for w in (cut, n - cut)]
  ad = kernels.join_adapters(list(zip(a, b)), 0.5)
  chosen = rng.random(rows) < 0.5
  got = np.asarray(jax.ffi.ffi_call(name + "_lora", out)(jnp.asarray(x), tiles, jnp.asarray(scale), ad.at, ad.b,
                                                         ad.ends, jnp.asarray(chosen, jnp.float32), layer=ONE),
                   np.float64)
  delta = np.concatenate([x.astype(np.float64) @ ai @ bi for ai, bi in zip(a, b)], axis=1) * 0.5
  want = want + delta * chosen[:, None]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"seed {seed}")


def test_the_kernel_runs_on_cpu_for_few_rows_and_xla_for_more():
  if not kernels.native_kernel_ready():
    pytest.skip("no C++ compiler on this machine: the XLA path serves every call")
  qw = kernels.quantize(jnp.ones((8, 16)))

  def hlo(rows):
    return jax.jit(kernels.int8_matmul).lower(jnp.ones((rows, 16)), qw).as_text()
  assert int8.FFI_TARGET in hlo(int8.KERNEL_MAX_ROWS)
  assert int8.FFI_TARGET not in hlo(int8.KERNEL_MAX_ROWS + 1)


def test_a_quantized_weight_reshapes_only_to_its_rows():
  qw = kernels.quantize(jnp.ones((3, 4, 10)), out_dims=2)
  flat = qw.reshape(12, -1)
  assert flat.shape == (12, 10) and flat.scale.shape == (12,)
  with pytest.raises(ValueError, match="12 rows"):
    qw.reshape(3, 40)


def test_tiles_hold_each_rows_column_pairs_side_by_side():
  rng = np.random.default_rng()
  n, k = int(rng.integers(1, 100)), int(rng.integers(1, 50))
  q = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
  tiles = np.asarray(kernels.tile_weights(jnp.asarray(q)))
  t, kp = -(-n // 32), -(-k // 8) * 8
  assert tiles.shape == (t, kp // 2, 32, 2)
  padded = np.zeros((t * 32, kp), np.int8)
  padded[:n, :k] = q
  for o in range(t * 32):
    for c in range(kp):
      assert tiles[o // 32, c // 2, o % 32, c % 2] == padded[o, c]


@pytest.mark.parametrize("kernel", [True, False])
def test_a_weight_holding_only_its_tiles_is_the_same_weight(kernel, monkeypatch):
  if not kernel:
    monkeypatch.setattr(int8, "native_kernel_ready", lambda: False)
  rng = np.random.default_rng()
  heads, dim, k = int(rng.integers(1, 5)), int(rng.integers(1, 40)), int(rng.integers(1, 90))
  qw = kernels.quantize(jnp.asarray(rng.normal(size=(heads, dim, k)), jnp.float32), out_dims=2)
  tiled = qw.without_rows()
  assert tiled.q is None and tiled.shape == (heads, dim, k) and tiled.ndim == 3
  np.testing.assert_array_equal(np.asarray(tiled.matrix()), np.asarray(qw.q).reshape(heads * dim, k))
  np.testing.assert_array_equal(np.asarray(tiled.dequantize()), np.asarray(qw.dequantize()))
  assert tiled.reshape(heads * dim, -1).shape == (heads * dim, k)
  with pytest.raises(ValueError, match="reshapes to \\[out, in\\]"):
    tiled.reshape(-1)
  x = jnp.asarray(rng.normal(size=(3, k)), jnp.float32)
  np.testing.assert_array_equal(np.asarray(kernels.int8_matmul(x, tiled.reshape(heads * dim, k))),
                                np.asarray(kernels.int8_matmul(x, qw.reshape(heads * dim, k))))


def rows_rounded_to_int8_groups(x, group=int8.ACTIVATION_GROUP):
  """The documented 8-bit rounding, in numpy: int8 values in groups of
  `group` columns (zeros past k) and one float32 scale per group."""
  m, k = x.shape
  kg = -(-k // group) * group
  xg = np.zeros((m, kg), np.float32)
  xg[:, :k] = x
  xg = xg.reshape(m, kg // group, group)
  amax = np.abs(xg).max(2)
  xs = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
  return np.clip(np.round(xg / xs[..., None]), -127, 127).astype(np.int64), xs


def int8_groups_product(x, q, scale):
  """float64 sum over groups of scale_g * (exact integer sum of the group),
  the magnitude of its terms, and the slack of `near_ties`: a step of that
  group's scale times the weight."""
  xq, xs = rows_rounded_to_int8_groups(x)
  m, groups, group = xq.shape
  qp = np.zeros((q.shape[0], groups * group), np.int64)
  qp[:, :q.shape[1]] = q
  qg = qp.reshape(q.shape[0], groups, group)
  sums = np.einsum("mgc,ngc->mng", xq, qg)
  magnitude = np.einsum("mgc,ngc->mng", np.abs(xq), np.abs(qg))
  xg = np.zeros((m, groups * group))
  xg[:, :x.shape[1]] = x
  tied = near_ties(xg.reshape(m, groups, group) / xs.astype(np.float64)[..., None])
  ties = np.einsum("mgc,ngc->mng", tied.astype(np.int64), np.abs(qg))
  xs64 = xs.astype(np.float64)[:, None, :]
  per = scale.astype(np.float64)[None, :]
  return (sums * xs64).sum(2) * per, (magnitude * xs64).sum(2) * per, (ties * xs64).sum(2) * per


@pytest.mark.parametrize("rows", [1, 3, 8, 13, int8.KERNEL_MAX_ROWS + 2])
@pytest.mark.parametrize("kernel", [True, False])
def test_the_8_bit_product_is_the_group_scaled_sum_of_exact_integer_products(rows, kernel, monkeypatch):
  """w8a8: each group of 32 columns of a token row rounded to int8 with its
  own scale; the kernel's integer sums of a group are exact, so the only
  error is float32's when the scaled groups are added."""
  serve_with(kernel, monkeypatch)
  rng, seed = fresh_rng()
  k, n = int(rng.integers(20, 700)), int(rng.integers(20, 300))
  qw = kernels.quantize(jnp.asarray(rng.normal(size=(n, k)), jnp.float32), activation_bits=8)
  assert qw.activation_bits == 8 and qw.tiles.dtype == jnp.uint8
  x = (rng.normal(size=(rows, k)) * rng.uniform(0.01, 100, size=(rows, 1))).astype(np.float32)
  x[0, : k // 3] = 0.0  # whole groups of zeros
  x[-1, int(rng.integers(k))] = 1e4  # an outlier column coarsens only its group
  got = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw), np.float64)
  want, magnitude, ties = int8_groups_product(x, np.asarray(qw.q, np.int64), np.asarray(qw.scale))
  assert (np.abs(got - want) <= 3e-6 * magnitude + ties + 1e-30).all(), f"seed {seed}"
  # and within the rounding's bound of the float64 product of the unrounded rows
  _, xs = rows_rounded_to_int8_groups(x)
  wdq = np.asarray(qw.q, np.float64) * np.asarray(qw.scale, np.float64)[:, None]
  exact = x.astype(np.float64) @ wdq.T
  half_step = np.repeat(xs.astype(np.float64) / 2, int8.ACTIVATION_GROUP, axis=1)[:, :k]
  assert (np.abs(got - exact) <= half_step @ np.abs(wdq).T + 1e-5 * np.abs(exact).max()).all(), f"seed {seed}"


@pytest.mark.parametrize("bits", [8, 16])
def test_many_row_blocks_over_runs_of_wide_tiles_give_each_rows_own_product(bits):
  """A prefill's rows go through the tiles in runs that stay in cache, every
  block of rows over one run before the next: with tiles of long rows (a run
  of one or two tiles), many tiles a thread and a last block of a few rows,
  each row's product is the one it has when multiplied alone."""
  if not kernels.native_kernel_ready():
    pytest.skip("no C++ kernel here")
  rng, seed = fresh_rng()
  k, n, rows = int(rng.integers(1400, 2100)), int(rng.integers(1500, 2200)), int(rng.integers(17, 40))
  qw = kernels.quantize(jnp.asarray(rng.normal(size=(n, k)), jnp.float32), activation_bits=bits)
  x = (rng.normal(size=(rows, k)) * rng.uniform(0.01, 100, size=(rows, 1))).astype(np.float32)
  product = jax.jit(kernels.int8_matmul)
  got = np.asarray(product(jnp.asarray(x), qw))
  alone = np.concatenate([np.asarray(product(jnp.asarray(x[r:r + 1]), qw)) for r in range(rows)])
  np.testing.assert_array_equal(got, alone, err_msg=f"seed {seed}")
  if bits == 8:
    want, magnitude, ties = int8_groups_product(x, np.asarray(qw.q, np.int64), np.asarray(qw.scale))
    assert (np.abs(got - want) <= 3e-6 * magnitude + ties + 1e-30).all(), f"seed {seed}"
  else:
    xq, xs = rows_rounded_to_int16(x)
    want = (xq @ np.asarray(qw.q, np.int64).T) * xs[:, None].astype(np.float64) * np.asarray(qw.scale, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"seed {seed}")


@pytest.mark.parametrize("kernel", [True, False])
def test_8_bit_products_add_joined_adapters_to_the_chosen_rows(kernel, monkeypatch):
  serve_with(kernel, monkeypatch)
  rng, seed = fresh_rng()
  rows, k, rank = int(rng.integers(1, 12)), int(rng.integers(20, 300)), int(rng.integers(1, 9))
  widths = [int(w) for w in rng.integers(1, 90, size=3)]
  a = [rng.normal(size=(k, rank)).astype(np.float32) for _ in widths]
  b = [rng.normal(size=(rank, w)).astype(np.float32) for w in widths]
  qw = kernels.quantize(jnp.asarray(rng.normal(size=(sum(widths), k)), jnp.float32), activation_bits=8)
  qw = qw.replace(adapters=kernels.join_adapters(list(zip(a, b)), 0.7))
  x = rng.normal(size=(rows, k)).astype(np.float32)
  chosen = rng.random(rows) < 0.5
  got = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw, jnp.asarray(chosen)), np.float64)
  base, _, ties = int8_groups_product(x, np.asarray(qw.q, np.int64), np.asarray(qw.scale))
  delta = np.concatenate([x.astype(np.float64) @ ai @ bi for ai, bi in zip(a, b)], axis=1) * 0.7
  want = base + delta * chosen[:, None]
  assert (np.abs(got - want) <= 1e-5 * np.abs(want) + 1e-5 * np.abs(want).max() + ties).all(), f"seed {seed}"


@BUILDS_GROUP
@pytest.mark.parametrize("flags", [pytest.param(("-mno-avx512vnni",), marks=pytest.mark.slow), ("-mno-avx512f",)],
                         ids=["no-vnni", "no-avx512"])  # CI: no AVX-512 at all, the plain loops too
def test_the_8_bit_kernel_built_without_vnni_or_avx512_forms_the_same_sums(flags, kernels_built_with):
  """The 8-bit path's plain loops (no VNNI) and scalar rounding (no AVX-512)
  against the numpy reference, the largest products included: a group's sum
  of 32 products of 127 and the weights' offset of 128 stays in int32."""
  name = build_without(flags, kernels_built_with, "Int8A8Matmul")
  rng, seed = fresh_rng()
  k, n, rows = int(rng.integers(40, 3000)), int(rng.integers(3, 70)), int(rng.integers(1, 12))
  q = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
  q[0], q[1] = 127, -127
  scale = rng.uniform(0.5, 2, size=n).astype(np.float32)
  x = rng.normal(size=(rows, k)).astype(np.float32)
  x[0] = np.abs(x[0]).max()  # every value rounds to 127
  out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
  got = np.asarray(jax.ffi.ffi_call(name, out)(jnp.asarray(x), kernels.tile_weights(jnp.asarray(q), 8),
                                               jnp.asarray(scale), layer=ONE), np.float64)
  want, magnitude, ties = int8_groups_product(x, q.astype(np.int64), scale)
  assert (np.abs(got - want) <= 3e-6 * magnitude + ties + 1e-30).all(), f"seed {seed}"


def test_8_bit_tiles_hold_each_rows_column_quads_offset_by_128():
  rng = np.random.default_rng()
  n, k = int(rng.integers(1, 100)), int(rng.integers(1, 80))
  q = rng.integers(-127, 128, size=(n, k)).astype(np.int8)
  tiles = np.asarray(kernels.tile_weights(jnp.asarray(q), 8))
  t, kg = -(-n // 32), -(-k // 32) * 32
  assert tiles.shape == (t, kg // 4, 32, 4) and tiles.dtype == np.uint8
  padded = np.zeros((t * 32, kg), np.int64)
  padded[:n, :k] = q
  o, c = np.meshgrid(np.arange(t * 32), np.arange(kg), indexing="ij")
  np.testing.assert_array_equal(tiles[o // 32, c // 4, o % 32, c % 4], padded + 128)
  np.testing.assert_array_equal(np.asarray(kernels.untile_weights(jnp.asarray(tiles), n, k)), q)
  with pytest.raises(ValueError, match="8 or 16 bits"):
    kernels.tile_weights(jnp.asarray(q), 4)


@pytest.mark.parametrize("bits", [16, 8])
@BUILDS_GROUP
@pytest.mark.parametrize("flags", [None, ("-mno-avx512f",)], ids=["native", "no-avx512"])
def test_bfloat16_adapters_give_the_products_of_their_float_values(bits, flags, kernels_built_with):
  """Adapters held in bfloat16 (half the bytes) are read as the float32
  values they hold: the same update as a float64 product of those values."""
  rng, seed = fresh_rng()
  rows, k, rank = int(rng.integers(1, 12)), int(rng.integers(20, 600)), int(rng.integers(1, 17))
  widths = [int(w) for w in rng.integers(1, 90, size=int(rng.integers(1, 4)))]
  a = [rng.normal(size=(k, rank)).astype(np.float32) for _ in widths]
  b = [rng.normal(size=(rank, w)).astype(np.float32) for w in widths]
  qw = kernels.quantize(jnp.asarray(rng.normal(size=(sum(widths), k)), jnp.float32), activation_bits=bits)
  ad = kernels.join_adapters(list(zip(a, b)), 2.0, jnp.bfloat16)
  assert ad.at.dtype == jnp.bfloat16 and ad.b.dtype == jnp.bfloat16
  x = rng.normal(size=(rows, k)).astype(np.float32)
  chosen = rng.random(rows) < 0.5
  at, bt = (np.asarray(v.astype(jnp.float32), np.float64) for v in (ad.at, ad.b))
  parts = np.searchsorted(np.asarray(ad.ends), np.arange(bt.shape[1]), side="right")
  u = (x.astype(np.float64) @ at.T).reshape(rows, len(widths), rank)
  delta = np.einsum("mnt,tn->mn", u[:, parts], bt)
  if flags is None:
    if not kernels.native_kernel_ready():
      pytest.skip("no C++ compiler on this machine")
    base = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw), np.float64)
    got = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw.replace(adapters=ad), jnp.asarray(chosen)),
                     np.float64)
  else:
    plain, lora = ("Int8Matmul", "Int8Bf16LoraMatmul") if bits == 16 else ("Int8A8Matmul", "Int8A8Bf16LoraMatmul")
    name = build_without(flags, kernels_built_with, plain, lora)
    out = jax.ShapeDtypeStruct((rows, qw.scale.shape[0]), jnp.float32)
    base = np.asarray(jax.ffi.ffi_call(name, out)(jnp.asarray(x), qw.tiles, qw.scale, layer=ONE), np.float64)
    got = np.asarray(jax.ffi.ffi_call(name + "_lora", out)(jnp.asarray(x), qw.tiles, qw.scale, ad.at, ad.b, ad.ends,
                                                           jnp.asarray(chosen, jnp.float32), layer=ONE),
                     np.float64)
  want = base + delta * chosen[:, None]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"seed {seed}")


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("bits", [16, 8])
def test_a_weight_of_a_stack_multiplies_as_its_own_layer_would(kernel, bits, monkeypatch):
  """`stack_layers` holds every layer's weight, scale and adapters in one
  array each: layer i's product reads its own part in place, as the weight
  holding its own arrays multiplies."""
  serve_with(kernel, monkeypatch)
  rng, seed = fresh_rng()
  layers, n, k, rank = 3, int(rng.integers(1, 80)), int(rng.integers(1, 100)), int(rng.integers(1, 6))
  own = []
  for _ in range(layers):
    w = kernels.quantize(jnp.asarray(rng.normal(size=(n, k)), jnp.float32), activation_bits=bits).without_rows()
    a, b = rng.normal(size=(k, rank)).astype(np.float32), rng.normal(size=(rank, n)).astype(np.float32)
    own.append(w.replace(adapters=kernels.join_adapters([(a, b)], 0.5)))
  stacked = kernels.stack_layers(own)
  assert stacked[0].tiles is stacked[2].tiles and stacked[1].tiles.shape == (layers, *own[1].tiles.shape)
  rows = int(rng.integers(1, 9))
  x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
  chosen = jnp.asarray(rng.random(rows) < 0.5)
  product = jax.jit(kernels.int8_matmul)
  for i in range(layers):
    want = np.asarray(product(x, own[i], chosen))
    np.testing.assert_allclose(np.asarray(product(x, stacked[i], chosen)), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max(), err_msg=f"layer {i}, seed {seed}")
    np.testing.assert_allclose(np.asarray(product(x, stacked[i].replace(adapters=None))),
                               np.asarray(product(x, own[i].replace(adapters=None))), rtol=1e-6, atol=1e-5,
                               err_msg=f"layer {i} without adapters, seed {seed}")


def test_the_kernel_refuses_a_layer_outside_its_stack():
  if not kernels.native_kernel_ready():
    pytest.skip("no C++ compiler on this machine: the XLA path serves every call")
  rng = np.random.default_rng()
  own = [kernels.quantize(jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)).without_rows() for _ in range(2)]
  beyond = kernels.stack_layers(own)[1].replace(layer=2)
  with pytest.raises(Exception, match="layer `layer` of a stack"):
    np.asarray(jax.jit(kernels.int8_matmul)(jnp.ones((1, 16), jnp.float32), beyond))
  with pytest.raises(ValueError, match="none stacked yet"):
    kernels.stack_layers([beyond, beyond])


@BUILDS_GROUP
def test_the_8_bit_products_on_amx_are_the_same_bits_as_on_vnni(kernels_built_with):
  """From eight token rows the native build's 8-bit products run on AMX where
  the CPU and the OS allow it (`products_use_amx`): the same integer sums of
  each group and the same float32 operations after them as the build without
  AMX, so the same bits, with and without adapters, at every row count (on
  AMX blocks of up to 16 rows, on VNNI of 8) and at widths and depths off the
  tiles' grid."""
  if not kernels.native_kernel_ready():
    pytest.skip("no C++ compiler on this machine")
  name = build_without(("-mno-amx-tile", "-mno-amx-int8"), kernels_built_with, "Int8A8Matmul",
                       "Int8A8Bf16LoraMatmul")
  rng, seed = fresh_rng()
  for rows in (1, 3, 4, 8, int(rng.integers(9, 30))):
    k, n = int(rng.integers(20, 1300)), int(rng.integers(1, 200))
    qw = kernels.quantize(jnp.asarray(rng.normal(size=(n, k)), jnp.float32), activation_bits=8)
    cut = int(rng.integers(1, n)) if n > 1 else 1
    rank = int(rng.integers(1, 17))
    pieces = [(rng.normal(size=(k, rank)).astype(np.float32), rng.normal(size=(rank, w)).astype(np.float32))
              for w in ((cut, n - cut) if n > 1 else (1,))]
    ad = kernels.join_adapters(pieces, 2.0, jnp.bfloat16)
    x = rng.normal(size=(rows, k)).astype(np.float32) * rng.lognormal(size=(rows, 1)).astype(np.float32)
    chosen = rng.random(rows) < 0.5
    out = jax.ShapeDtypeStruct((rows, n), jnp.float32)
    native = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw))
    native_lora = np.asarray(jax.jit(kernels.int8_matmul)(jnp.asarray(x), qw.replace(adapters=ad),
                                                          jnp.asarray(chosen)))
    vnni = np.asarray(jax.ffi.ffi_call(name, out)(jnp.asarray(x), qw.tiles, qw.scale, layer=ONE))
    vnni_lora = np.asarray(jax.ffi.ffi_call(name + "_lora", out)(jnp.asarray(x), qw.tiles, qw.scale, ad.at, ad.b,
                                                                 ad.ends, jnp.asarray(chosen, jnp.float32),
                                                                 layer=ONE))
    np.testing.assert_array_equal(native, vnni, err_msg=f"seed {seed}, {rows} rows")
    np.testing.assert_array_equal(native_lora, vnni_lora, err_msg=f"seed {seed}, {rows} rows, adapters")
  print("native build on AMX:", kernels.products_use_amx())


@BUILDS_GROUP
def test_a_build_says_whether_it_has_its_vector_paths(kernels_built_with):
  """`CpuKernelsVectorized`: 1 where compiled for AVX-512 BW and VNNI, as /proc/cpuinfo says this CPU has
  (`-march=native`), 0 built without AVX-512; `kernels_vectorized` reports the loaded build's, and
  `attention_ready` and `f32_rows_ready` their AVX2 paths'."""
  import ctypes
  import os
  if not os.path.exists("/proc/cpuinfo"):
    pytest.skip("reads the CPU's flags from /proc/cpuinfo")
  with open("/proc/cpuinfo", encoding="utf-8") as f:
    cpu_flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
  has = {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags
  assert kernels.kernels_vectorized() == has
  assert ctypes.cdll.LoadLibrary(kernels_built_with(("-mno-avx512f",))).CpuKernelsVectorized() == 0
  # the decoding attention and the float32 products: AVX-512, or AVX2 with FMA
  wide = "avx512f" in cpu_flags or {"avx2", "fma"} <= cpu_flags
  assert kernels.int8.attention_ready() == wide and kernels.int8.f32_rows_ready() == wide
