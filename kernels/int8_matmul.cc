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
//
// The weight rows are split over XLA's own intra-op thread pool, so the
// kernel starts no threads of its own beside XLA's (an OpenMP team decoded
// at the same speed to within a few percent, measured).
//
// Int8LoraMatmul adds low-rank adapters to chosen token rows in the same call
// (y[m] += rows[m] * (x[m] @ A_p) @ Bt_p^T over the output rows of adapter p):
// a diffusion model adapted from a frozen AR base applies them to its noisy
// rows only, and as separate small products they cost XLA:CPU a third of a
// decoding pass in per-operation overhead (measured).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kInt16Max = 32767.f;
// An int32 lane of the VNNI sum takes two products per 32 columns; after 8192
// columns it holds at most 512 * 127 * 32767 < 2^31, so lanes are emptied into
// int64 totals that often.
constexpr int64_t kChunk = 8192;
// Without VNNI one int32 sum takes every product of its chunk: 512 of them
// stay below 2^31.
constexpr int64_t kScalarChunk = 512;

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
    for (int64_t c0 = 0; c0 < k; c0 += kScalarChunk) {
      const int64_t c1 = c0 + kScalarChunk < k ? c0 + kScalarChunk : k;
      int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = c0; i < c1; ++i) acc += int32_t(xr[i]) * int32_t(w[i]);
      dots[r] += acc;
    }
  }
#endif
}

// sum_t a[t] * b[t] in float32: an adapter's update of one output, in vector
// registers (the scalar loop it replaced cost 1.5 to 2 ms of a 35 ms revising
// pass of the adapted default, measured).
inline float Dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + t), _mm512_loadu_ps(b + t), acc);
  if (t < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - t)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + t), _mm512_maskz_loadu_ps(mask, b + t), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t t = 0; t < n; ++t) acc += a[t] * b[t];
  return acc;
#endif
}

// Low-rank adapters of one weight's output rows: u = x @ A for every token
// row (float32, [m, P * r]), adapter p's `bt` rows for output rows
// [ends[p - 1], ends[p]), and the rows' weights (0: the adapters skip a row).
struct Adapters {
  const float* u;
  const float* bt;
  const int32_t* ends;
  int64_t parts;
  int64_t rank;
  const float* rows;
};

// Output rows [j0, j1) of the M token rows from m0 on.
template <int M>
void RowsTimesWeight(const int16_t* xq, const float* xs, const int8_t* q, const float* scale, const Adapters* ad,
                     float* y, int64_t m0, int64_t k, int64_t n, int64_t j0, int64_t j1) {
  int64_t part = 0;
  for (int64_t j = j0; j < j1; ++j) {
    int64_t dots[M];
    RowsTimesWeightRow<M>(xq + m0 * k, k, q + j * k, dots);
    for (int r = 0; r < M; ++r) {
      float out = static_cast<float>(static_cast<double>(dots[r]) * xs[m0 + r] * scale[j]);
      if (ad != nullptr && ad->rows[m0 + r] != 0.f) {
        while (part + 1 < ad->parts && j >= ad->ends[part]) ++part;
        const float* u = ad->u + (m0 + r) * ad->parts * ad->rank + part * ad->rank;
        out += ad->rows[m0 + r] * Dot(u, ad->bt + j * ad->rank, ad->rank);
      }
      y[(m0 + r) * n + j] = out;
    }
  }
}

using Block = void (*)(const int16_t*, const float*, const int8_t*, const float*, const Adapters*, float*, int64_t,
                       int64_t, int64_t, int64_t, int64_t);
constexpr int kMaxBlock = 16;
constexpr Block kBlocks[kMaxBlock] = {
    RowsTimesWeight<1>,  RowsTimesWeight<2>,  RowsTimesWeight<3>,  RowsTimesWeight<4>,
    RowsTimesWeight<5>,  RowsTimesWeight<6>,  RowsTimesWeight<7>,  RowsTimesWeight<8>,
    RowsTimesWeight<9>,  RowsTimesWeight<10>, RowsTimesWeight<11>, RowsTimesWeight<12>,
    RowsTimesWeight<13>, RowsTimesWeight<14>, RowsTimesWeight<15>, RowsTimesWeight<16>};

// Runs fn(c) for c in [0, chunks) on the calling thread and XLA's pool, each
// taking the next chunk until none is left; returns when all are done. A
// task the pool starts late finds no chunk and touches nothing else.
template <typename F>
void ForEachChunk(ffi::ThreadPool& pool, int64_t chunks, F fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  // Helpers hold `state` alive; `fn` is read only while a chunk is left, and
  // the caller waits for every chunk, so it outlives those reads.
  auto work = [state, chunks, fnp = &fn]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      (*fnp)(c);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

ffi::Error Multiply(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k, const int8_t* q, const float* scale,
                    int64_t n, const Adapters* ad, float* y) {
  std::vector<int16_t> xq(m * k);
  std::vector<float> xs(m);
  QuantizeRows(x, m, k, xq.data(), xs.data());
  // A few chunks a thread, whole cache lines of output rows each, for balance.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = std::max<int64_t>(16, (n + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (n + per - 1) / per;
  // Up to 16 token rows read each weight once; more rows take it again.
  for (int64_t m0 = 0; m0 < m; m0 += kMaxBlock) {
    const int64_t rows = m - m0 < kMaxBlock ? m - m0 : kMaxBlock;
    ForEachChunk(pool, chunks, [&](int64_t c) {
      const int64_t j0 = c * per, j1 = std::min(n, j0 + per);
      kBlocks[rows - 1](xq.data(), xs.data(), q, scale, ad, y, m0, k, n, j0, j1);
    });
  }
  return ffi::Error::Success();
}

bool Want2d(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S8>& q, ffi::Buffer<ffi::F32>& scale) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  return xd.size() == 2 && qd.size() == 2 && xd[1] == qd[1] && scale.element_count() == qd[0];
}

}  // namespace

static ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                                 ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  if (!Want2d(x, q, scale)) return ffi::Error::InvalidArgument("int8_matmul: want x [m, k], q [n, k] and scale [n]");
  return Multiply(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], q.typed_data(), scale.typed_data(),
                  q.dimensions()[0], nullptr, y->typed_data());
}

static ffi::Error Int8LoraMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                                     ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> at, ffi::Buffer<ffi::F32> bt,
                                     ffi::Buffer<ffi::S32> ends, ffi::Buffer<ffi::F32> rows,
                                     ffi::ResultBuffer<ffi::F32> y) {
  if (!Want2d(x, q, scale)) {
    return ffi::Error::InvalidArgument("int8_lora_matmul: want x [m, k], q [n, k] and scale [n]");
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = q.dimensions()[0];
  const int64_t parts = ends.element_count();
  auto ad_ = at.dimensions();
  auto bd = bt.dimensions();
  if (parts < 1 || ad_.size() != 2 || bd.size() != 2 || ad_[1] != k || bd[0] != n || ad_[0] != parts * bd[1] ||
      rows.element_count() != m) {
    return ffi::Error::InvalidArgument(
        "int8_lora_matmul: want at [parts * rank, k], bt [n, rank], ends [parts] and rows [m]");
  }
  const int64_t rank = bd[1];
  // u = x @ A, [m, parts * rank], for the rows the adapters act on.
  std::vector<float> u(m * parts * rank, 0.f);
  const float* xp = x.typed_data();
  const float* ap = at.typed_data();
  const float* rp = rows.typed_data();
  for (int64_t r = 0; r < m; ++r) {
    if (rp[r] == 0.f) continue;
    for (int64_t c = 0; c < parts * rank; ++c) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < k; ++i) acc += xp[r * k + i] * ap[c * k + i];
      u[r * parts * rank + c] = acc;
    }
  }
  Adapters ad{u.data(), bt.typed_data(), ends.typed_data(), parts, rank, rp};
  return Multiply(pool, xp, m, k, q.typed_data(), scale.typed_data(), n, &ad, y->typed_data());
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int8LoraMatmul, Int8LoraMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
