// Products of a few float32 token rows and a weight stored [out, in], on CPU.
//
// XLA:CPU forms the product of one row as a matrix-vector product that
// streams the weight once, but from two rows on it runs a matrix product
// whose cost grows with the rows: a revising pass of seven rows took 2.5
// times a one-row step in the MLP's products on an AVX2 CPU, where reading
// the weight once would bound both. Here every output row of the weight is
// read once for all the token rows, each of which keeps its own
// accumulators, so a pass of a few rows costs about what one row costs.
//
// A row's dot product is summed the same way whatever the number of rows
// beside it (eight lanes over the columns, then the lanes in a fixed order):
// a row gets the same bits alone (an AR step) as in a revising pass.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using mdlm_jax::ForEachChunk;

namespace {

#if defined(__AVX__)
typedef __m256 Lanes;  // eight float32 lanes
#else
typedef float Lanes __attribute__((vector_size(32)));
#endif
constexpr int64_t kLanes = 8;
constexpr int64_t kGroupRows = 8;  // token rows whose accumulators a pass over a weight row holds
constexpr int64_t kMaxRows = 64;   // token rows a call takes, in groups of kGroupRows
constexpr int64_t kTasksPerThread = 2;  // contiguous ranges of output rows a thread's share is cut into
constexpr int64_t kBlock = 32;  // output rows whose weight rows every group of token rows reads while cached
constexpr int64_t kPrefetch = 256;  // floats ahead in a weight row that a step asks the cache for

inline Lanes Load(const float* p) {
  Lanes v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline Lanes MulAdd(Lanes a, Lanes b, Lanes c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

// The lanes of `v` added in one fixed order.
inline float LaneSum(Lanes v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// y[r, o] for the M rows of x [M, k] and the output rows [o0, o1) of w [out, k], N weight rows at a
// time. A token row's accumulator is one chain of dependent multiply-adds, so M chains alone wait on
// the adds' latency: six rows ran at 38% of the arithmetic's peak from cache, near enough the rate
// the memory feeds that a revising pass's products cost a fifth more than a step's. N weight rows
// side by side give M * N independent chains and load each token row's stretch once for all N.
// Every (r, o) is still summed alone in the same order, so the bits depend neither on N nor on M.
template <int M, int N>
__attribute__((always_inline)) inline void RowsOf(const float* x, int64_t k, const float* w, int64_t o, float* y, int64_t out) {
  const int64_t body = k - k % kLanes;
  const float* wo[N];
  for (int n = 0; n < N; ++n) wo[n] = w + (o + n) * k;
  Lanes acc[N][M];
  for (int n = 0; n < N; ++n)
    for (int r = 0; r < M; ++r) acc[n][r] = Lanes{0, 0, 0, 0, 0, 0, 0, 0};
  // One weight row streams best with its own prefetches a little ahead of it. The next N weight rows
  // lie right after N of them: those are asked for in one linear stream, as far ahead as this group
  // reads (N streams of their own lost a third of the rate from memory).
  const float* next = w + (o + N) * k;
  const bool ahead = o + 2 * N <= out;
  for (int64_t i = 0; i < body; i += kLanes) {
    if constexpr (N == 1) {
      if (i % (2 * kLanes) == 0) __builtin_prefetch(wo[0] + i + kPrefetch);
    } else if (ahead) {
      for (int j = 0; j < N * kLanes; j += 2 * kLanes) __builtin_prefetch(next + i * N + j);
    }
    Lanes wv[N];
    for (int n = 0; n < N; ++n) wv[n] = Load(wo[n] + i);
    for (int r = 0; r < M; ++r) {
      const Lanes xv = Load(x + r * k + i);
      for (int n = 0; n < N; ++n) acc[n][r] = MulAdd(wv[n], xv, acc[n][r]);
    }
  }
  for (int n = 0; n < N; ++n) {
    for (int r = 0; r < M; ++r) {
      float s = LaneSum(acc[n][r]);
      for (int64_t i = body; i < k; ++i) s += wo[n][i] * x[r * k + i];
      y[r * out + o + n] = s;
    }
  }
}

// Weight rows read side by side for M token rows: as many as keep the M * N accumulators and the N
// weight stretches within 16 vector registers. One token row keeps one: bound by the memory either
// way, it read fastest with its own prefetches (measured against 2 and 4 on an AVX2 CPU).
constexpr int SideBySide(int m) { return m == 1 ? 1 : m == 2 ? 4 : m <= 4 ? 3 : m <= 7 ? 2 : 1; }

template <int M>
void Rows(const float* x, int64_t k, const float* w, int64_t o0, int64_t o1, float* y, int64_t out) {
  constexpr int N = SideBySide(M);
  int64_t o = o0;
  for (; o + N <= o1; o += N) RowsOf<M, N>(x, k, w, o, y, out);
  for (; o < o1; ++o) RowsOf<M, 1>(x, k, w, o, y, out);
}

using RowsFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);

RowsFn RowsFor(int64_t m) {
  static constexpr RowsFn kFns[kGroupRows] = {Rows<1>, Rows<2>, Rows<3>, Rows<4>, Rows<5>, Rows<6>, Rows<7>, Rows<8>};
  return kFns[m - 1];
}

}  // namespace

// x [m, k], w [out, k]; y [m, out].
static ffi::Error F32RowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                    ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || xd[0] < 1 || xd[0] > kMaxRows) {
    return ffi::Error::InvalidArgument("f32_rows_matmul: want x [m, k] with 1 <= m <= 64 and w [out, k]");
  }
  const int64_t m = xd[0], k = xd[1], out = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Each task takes one contiguous range of output rows, so a thread streams long runs of the weight
  // and the prefetches run ahead of it (tasks of 32 rows handed out in turn made the two threads read
  // short alternating stretches: a six-row revising pass took 35.9 to 39.8 ms against 31.4 on an
  // AVX2 CPU). The range is walked in blocks of kBlock rows, each for every group of token rows in
  // turn, so the groups after the first read the block's weight rows from cache.
  const int64_t tasks = std::min<int64_t>(out, kTasksPerThread * std::max<int64_t>(1, pool.num_threads()));
  const int64_t per = (out + tasks - 1) / tasks;
  ForEachChunk(pool, tasks, [&](int64_t c) {
    const int64_t end = std::min(out, (c + 1) * per);
    for (int64_t o0 = std::min(out, c * per); o0 < end; o0 += kBlock) {
      const int64_t o1 = std::min(end, o0 + kBlock);
      for (int64_t r = 0; r < m; r += kGroupRows) {
        RowsFor(std::min(kGroupRows, m - r))(xp + r * k, k, wp, o0, o1, yp + r * out, out);
      }
    }
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(F32RowsMatmul, F32RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether this build vectorizes the products (AVX2 with FMA, or AVX-512):
// elsewhere XLA's own products serve.
extern "C" int F32RowsVectorized() {
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
