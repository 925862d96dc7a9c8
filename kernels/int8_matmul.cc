// Weight-only int8 products for decoding on CPU, called from JAX through the
// XLA FFI (kernels/int8.py builds and registers this file).
//
// y[m, n] = xs[m] * scale[n] * sum_k xq[m, k] * q[n, k], where xq is each
// token row x[m] rounded to 16-bit integers (xs[m] = max |x[m]| / 32767) and
// the sum is exact in integers. A decoding pass multiplies a few token rows by
// every weight, so it should be bound by reading the weights: with integer
// dot products (AVX-512 VNNI's vpdpwssd, 32 products an instruction) each
// int8 weight row is widened to int16 in registers and multiplied by every
// token row as it streams past, one weight row at a time (interleaving rows
// defeated the hardware prefetcher, measured). XLA:CPU does not fuse an
// int8 -> float convert into a dot (it writes a float copy of the weight
// first, every pass), which is why this is a kernel of its own. Without VNNI
// the same integer sums are formed by a plain loop the compiler vectorizes.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kInt16Max = 32767.f;
// An int32 lane of the VNNI sum takes two products per 32 columns; after 8192
// columns it holds at most 512 * 127 * 32767 < 2^31, so lanes are emptied into
// int64 totals that often.
constexpr int64_t kChunk = 8192;

// Rounds each of the m rows of x to int16 with its own scale.
void QuantizeRows(const float* x, int64_t m, int64_t k, int16_t* xq, float* xs) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(row[i]));
    const float scale = amax > 0.f ? amax / kInt16Max : 1.f;
    xs[r] = scale;
    for (int64_t i = 0; i < k; ++i) {
      float v = std::nearbyint(row[i] / scale);
      v = std::fmin(std::fmax(v, -kInt16Max), kInt16Max);
      xq[r * k + i] = static_cast<int16_t>(v);
    }
  }
}

// dots[r] = sum_i xq[r, i] * w[i] for the M token rows, exactly.
template <int M>
inline void RowsTimesWeightRow(const int16_t* xq, int64_t k, const int8_t* w, int64_t* dots) {
  for (int r = 0; r < M; ++r) dots[r] = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
    const int64_t c1 = c0 + kChunk < k ? c0 + kChunk : k;
    __m512i acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_si512();
    int64_t i = c0;
    for (; i + 32 <= c1; i += 32) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
      for (int r = 0; r < M; ++r) acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_loadu_si512(xq + r * k + i), wv);
    }
    if (i < c1) {
      const __mmask32 mask = static_cast<__mmask32>((1ull << (c1 - i)) - 1);
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + i));
      for (int r = 0; r < M; ++r)
        acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maskz_loadu_epi16(mask, xq + r * k + i), wv);
    }
    for (int r = 0; r < M; ++r) {
      const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[r]));
      const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[r], 1));
      dots[r] += _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
    }
  }
#else
  for (int r = 0; r < M; ++r) {
    const int16_t* xr = xq + r * k;
    for (int64_t c0 = 0; c0 < k; c0 += kChunk) {
      const int64_t c1 = c0 + kChunk < k ? c0 + kChunk : k;
      int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = c0; i < c1; ++i) acc += int32_t(xr[i]) * int32_t(w[i]);
      dots[r] += acc;
    }
  }
#endif
}

// The M token rows from m0 on, times every weight row, the weight rows split
// over the cores.
template <int M>
void RowsTimesWeight(const int16_t* xq, const float* xs, const int8_t* q, const float* scale, float* y,
                     int64_t m0, int64_t k, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    int64_t dots[M];
    RowsTimesWeightRow<M>(xq + m0 * k, k, q + j * k, dots);
    for (int r = 0; r < M; ++r)
      y[(m0 + r) * n + j] = static_cast<float>(static_cast<double>(dots[r]) * xs[m0 + r] * scale[j]);
  }
}

using Block = void (*)(const int16_t*, const float*, const int8_t*, const float*, float*, int64_t, int64_t,
                       int64_t);
constexpr int kMaxBlock = 16;
constexpr Block kBlocks[kMaxBlock] = {
    RowsTimesWeight<1>,  RowsTimesWeight<2>,  RowsTimesWeight<3>,  RowsTimesWeight<4>,
    RowsTimesWeight<5>,  RowsTimesWeight<6>,  RowsTimesWeight<7>,  RowsTimesWeight<8>,
    RowsTimesWeight<9>,  RowsTimesWeight<10>, RowsTimesWeight<11>, RowsTimesWeight<12>,
    RowsTimesWeight<13>, RowsTimesWeight<14>, RowsTimesWeight<15>, RowsTimesWeight<16>};

}  // namespace

static ffi::Error Int8MatmulImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scale,
                                 ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || xd[1] != qd[1] || scale.element_count() != qd[0]) {
    return ffi::Error::InvalidArgument("int8_matmul: want x [m, k], q [n, k] and scale [n]");
  }
  const int64_t m = xd[0], k = xd[1], n = qd[0];
  std::vector<int16_t> xq(m * k);
  std::vector<float> xs(m);
  QuantizeRows(x.typed_data(), m, k, xq.data(), xs.data());
  // Up to 16 token rows read each weight once; more rows take it again.
  for (int64_t m0 = 0; m0 < m; m0 += kMaxBlock) {
    const int64_t rows = m - m0 < kMaxBlock ? m - m0 : kMaxBlock;
    kBlocks[rows - 1](xq.data(), xs.data(), q.typed_data(), scale.typed_data(), y->typed_data(), m0, k, n);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
