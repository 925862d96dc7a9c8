// Weight-only int8 products for decoding on CPU, called from JAX through the
// XLA FFI (kernels/int8.py builds and registers this file).
//
// y[m, n] = xs[m] * scale[n] * sum_k xq[m, k] * q[n, k], where xq is each
// token row x[m] rounded to 16-bit integers (xs[m] = max |x[m]| / 32767) and
// the sum is exact in integers. A decoding pass multiplies a few token rows by
// every weight, so it should be bound by reading the weights. The weights come
// in tiles of 32 output rows whose column pairs sit side by side
// (`kernels.tile_weights`, made once at load): each step widens one column
// pair of 32 rows to int16 in registers and multiplies it by each token row's
// pair with AVX-512 VNNI's vpdpwssd (32 products an instruction), so the sums
// of 16 output rows build up in the lanes of one register and are never
// reduced across it. (The [out, in] layout, one weight row against every
// token row, spent a third of its instructions reducing registers: 10.4 ms
// for SmolLM2's products at eight rows, against 6.7 for the tiles, measured.)
// XLA:CPU does not fuse an int8 -> float convert into a dot (it writes a
// float copy of the weight first, every pass), which is why this is a kernel
// of its own. Without VNNI the same integer sums are formed by a plain loop
// the compiler vectorizes.
//
// The tiles are split over XLA's own intra-op thread pool, so the
// kernel starts no threads of its own beside XLA's (an OpenMP team decoded
// at the same speed to within a few percent, measured).
//
// Int8A8Matmul (the "w8a8" decode dtype) rounds the token rows to 8 bits
// instead, with a scale per row and group of kGroup columns (llama.cpp's Q8_0
// blocks, so an outlier column coarsens only its own group), and multiplies
// with vpdpbusd: 64 products an instruction and no widening of the weights,
// which it reads as uint8 (w + 128) in tiles of column quads
// (`kernels.tile_weights(q, 8)`). The offset comes back out exactly:
// each group's sums start at -128 * sum(xq) of that group.
//
// Int8LoraMatmul adds low-rank adapters to chosen token rows in the same call
// (y[m] += rows[m] * (x[m] @ A_p) @ B_p over the output rows of adapter p):
// a diffusion model adapted from a frozen AR base applies them to its noisy
// rows only, and as separate small products they cost XLA:CPU a third of a
// decoding pass in per-operation overhead (measured).
// The adapters come in float32 or in bfloat16 (Int8Bf16LoraMatmul, Int8A8Bf16LoraMatmul):
// their cost is the bytes read, so the decoding copy holds them in bfloat16 where
// that is exact.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

// The AMX path (its epilogue is AVX-512).
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define MDLM_JAX_AMX 1
#else
#define MDLM_JAX_AMX 0
#endif

namespace ffi = xla::ffi;
using mdlm_jax::ForEachChunk;

namespace {

constexpr float kInt16Max = 32767.f;
// The weights come in tiles of kTile output rows (`kernels.tile_weights`):
// [tiles, pairs, kTile, 2], each column pair of the kTile rows side by side,
// the columns padded with zeros to a multiple of kPad.
constexpr int64_t kTile = 32;
constexpr int64_t kPad = 8;
// An int32 lane takes one column pair's products (at most 2 * 127 * 32767)
// a step: after 256 pairs it holds less than 2^31, so the lanes are emptied
// into int64 totals that often.
constexpr int64_t kPairChunk = 256;

// The weights are read once a pass, in order, and the products waited on those
// reads (`perf annotate`: most samples on the weight loads) though the next
// bytes' addresses are known: each step asks for the cache lines kPrefetchAhead
// bytes on. SmolLM2's 8-bit products at eight token rows went from 10.7 to
// 8.0 ms, at one row from 6.1 to 4.9 (any distance from 1 to 8 KB alike).
constexpr int64_t kPrefetchAhead = 2048;
// The 8-bit products of several token rows (a revising pass's six) ask 8 KB
// ahead, and their group's eight column quads are unrolled: GCC otherwise
// copies every accumulator in and out of spare registers each quad (24 moves
// beside 12 vpdpbusd at six rows), and the loop stalled on the weights' loads.
// Interleaved in one process (two builds, SmolLM2's generation on 8 held-out
// code prompts, eight rounds): a six-row pass went 9.30 -> 8.21 ms.
// The 8-bit products ask for their lines into L2 (the T1 hint), not L1: on an
// AMD Zen 4 (AVX-512, 2 cores) SmolLM2's products in a jitted loop of passes,
// settings interleaved in one process, took 4.76 -> 4.51 ms at one token row
// and 5.42 -> 4.92 at six (best of 12; medians 5.29 -> 4.90 and 6.70 -> 5.48),
// with 8 KB as good as 16 or 32 KB ahead and better than no prefetch.
constexpr int64_t kPrefetchAheadA8 = 8192;

// Asks for the `lines` cache lines `ahead` bytes past `at` (a prefetch past
// the end of an array does not fault), into the cache level `hint` says.
template <int64_t ahead = kPrefetchAhead, int hint = _MM_HINT_T0>
inline void Prefetch(const void* at, int lines) {
  const char* p = static_cast<const char*>(at) + ahead;
  for (int l = 0; l < lines; ++l) _mm_prefetch(p + 64 * l, static_cast<_mm_hint>(hint));
}

// Rounds each of the m rows of x [m, k] to int16 with its own scale, into
// rows of kp columns (zeros past k). Vectorized with the same IEEE division
// and round-half-to-even as the scalar form, so both give the same values
// (`kernels.round_rows_to_int16` is the reference); as a scalar loop it cost
// about 9 us a call at eight rows, a millisecond of a pass's 121 calls.
void QuantizeRows(const float* x, int64_t m, int64_t k, int64_t kp, int16_t* xq, float* xs) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    int16_t* out = xq + r * kp;
    int64_t i = 0;
    float amax = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 vmax = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
    amax = _mm512_reduce_max_ps(vmax);
#endif
    for (; i < k; ++i) amax = std::fmax(amax, std::fabs(row[i]));
    const float scale = amax > 0.f ? amax / kInt16Max : 1.f;
    xs[r] = scale;
    i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-kInt16Max), hi = _mm512_set1_ps(kInt16Max);
    for (; i + 16 <= k; i += 16) {
      __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(row + i), vs),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v)));
    }
#endif
    for (; i < k; ++i) {
      float v = std::nearbyint(row[i] / scale);
      v = std::fmin(std::fmax(v, -kInt16Max), kInt16Max);
      out[i] = static_cast<int16_t>(v);
    }
    for (int64_t j = k; j < kp; ++j) out[j] = 0;
  }
}

// Columns of a token row that share one 8-bit scale ("w8a8"); a multiple of 16.
constexpr int64_t kGroup = 32;
constexpr float kInt8Max = 127.f;
// From this many token rows the 8-bit products run on AMX where it can. Below
// it vpdpbusd's products hide under the weights' reads, while each group's tile
// set-up, multiply and round trip of the sums through memory do not: at six
// rows (a revising pass) SmolLM2's layer products took 1.88 ms on VNNI and
// 2.3-2.8 on AMX outside XLA, 6.5 against 6.9 ms a pass in a profiled
// generation. At eight rows AMX is ahead (docs/weight-layouts.md).
constexpr int kAmxMinRows = 8;

// Rounds each of the m rows of x [m, k] to int8 with a scale per group of
// kGroup columns, into rows of kg columns (zeros past k): xs [m, kg / kGroup]
// the scales (max |x| of the group / 127, 1 for an all-zero group), xoff the
// groups' -128 * sum(xq), which undoes the weights' +128 offset. The same
// IEEE division and round-half-to-even in vectors and in the scalar form
// (`kernels.round_rows_to_int8_groups` is the reference).
void QuantizeRowsA8(const float* x, int64_t m, int64_t k, int64_t kg, int8_t* xq, float* xs, int32_t* xoff) {
  const int64_t groups = kg / kGroup;
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * kGroup, len = std::max<int64_t>(0, std::min(kGroup, k - c0));
      int8_t* out = xq + r * kg + c0;
      float amax = 0.f;
      int32_t sum = 0;
      int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // One reduction a group for the maximum and one for the sum (a pair
      // per 16 columns cost a third of this function's time, measured).
      __m512 v[kGroup / 16];
      __m512 vmax = _mm512_setzero_ps();
      for (int h = 0; h < kGroup / 16; ++h) {
        const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, len - 16 * h));
        const __mmask16 mask = left == 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
        v[h] = _mm512_maskz_loadu_ps(mask, row + c0 + 16 * h);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v[h]));
      }
      amax = _mm512_reduce_max_ps(vmax);
      const float scale = amax > 0.f ? amax / kInt8Max : 1.f;
      const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-kInt8Max), hi = _mm512_set1_ps(kInt8Max);
      __m512i vsum = _mm512_setzero_si512();
      for (int h = 0; h < kGroup / 16; ++h) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v[h], vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, lo), hi));
        vsum = _mm512_add_epi32(vsum, qi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), _mm512_cvtepi32_epi8(qi));
      }
      sum = _mm512_reduce_add_epi32(vsum);
      i = kGroup;
#else
      for (int64_t c = 0; c < len; ++c) amax = std::fmax(amax, std::fabs(row[c0 + c]));
      const float scale = amax > 0.f ? amax / kInt8Max : 1.f;
#endif
      for (; i < kGroup; ++i) {
        float q = i < len ? std::nearbyint(row[c0 + i] / scale) : 0.f;
        q = std::fmin(std::fmax(q, -kInt8Max), kInt8Max);
        out[i] = static_cast<int8_t>(q);
        sum += static_cast<int32_t>(q);
      }
      xs[r * groups + g] = scale;
      xoff[r * groups + g] = -128 * sum;
    }
  }
}

// tot[r][o] = sum_g xs[r, g] * sum_{i in g} xq[r, i] * w[o, i] for the M
// token rows and the kTile output rows of one tile of column quads, the
// weights held as uint8 w + 128. Each group's integer sums are exact (below
// 2^24, so exact in float too) and are scaled and added in float32.
template <int M>
inline void TileTimesRowsA8(const int8_t* xq, int64_t kg, const float* xs, const int32_t* xoff, const uint8_t* w,
                            float (*tot)[kTile]) {
  const int64_t groups = kg / kGroup;
  constexpr int64_t kQuads = kGroup / 4;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 facc[M][2];
  for (int r = 0; r < M; ++r) facc[r][0] = facc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[M][2];
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm512_set1_epi32(xoff[r * groups + g]);
    auto quad_step = [&](int64_t i) {
      const uint8_t* wi = w + i * 4 * kTile;
      Prefetch<kPrefetchAheadA8, _MM_HINT_T1>(wi, 2);
      const __m512i w0 = _mm512_loadu_si512(wi);
      const __m512i w1 = _mm512_loadu_si512(wi + 64);
      for (int r = 0; r < M; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * kg + 4 * i, sizeof(quad));
        const __m512i xb = _mm512_set1_epi32(quad);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xb);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xb);
      }
    };
    if constexpr (M == 1) {
      for (int64_t i = g * kQuads; i < (g + 1) * kQuads; ++i) quad_step(i);
    } else {
#pragma GCC unroll 8
      for (int64_t i = g * kQuads; i < (g + 1) * kQuads; ++i) quad_step(i);
    }
    for (int r = 0; r < M; ++r) {
      const __m512 sx = _mm512_set1_ps(xs[r * groups + g]);
      facc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), sx, facc[r][0]);
      facc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), sx, facc[r][1]);
    }
  }
  for (int r = 0; r < M; ++r) {
    _mm512_storeu_ps(tot[r], facc[r][0]);
    _mm512_storeu_ps(tot[r] + 16, facc[r][1]);
  }
#else
  for (int r = 0; r < M; ++r) {
    const int8_t* xr = xq + r * kg;
    for (int64_t o = 0; o < kTile; ++o) tot[r][o] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t acc[kTile];
      for (int64_t o = 0; o < kTile; ++o) acc[o] = xoff[r * groups + g];
      for (int64_t i = g * kQuads; i < (g + 1) * kQuads; ++i) {
        const uint8_t* wi = w + i * 4 * kTile;
        const int32_t x0 = xr[4 * i], x1 = xr[4 * i + 1], x2 = xr[4 * i + 2], x3 = xr[4 * i + 3];
#pragma omp simd
        for (int64_t o = 0; o < kTile; ++o)
          acc[o] += x0 * int32_t(wi[4 * o]) + x1 * int32_t(wi[4 * o + 1]) + x2 * int32_t(wi[4 * o + 2]) +
                    x3 * int32_t(wi[4 * o + 3]);
      }
      const float sx = xs[r * groups + g];
      for (int64_t o = 0; o < kTile; ++o) tot[r][o] += static_cast<float>(acc[o]) * sx;
    }
  }
#endif
}

#if MDLM_JAX_AMX
// Intel AMX: a tile multiply (tdpbsud) forms the products of up to 16 token
// rows and 16 output rows over 64 columns in one instruction, where vpdpbusd
// forms those of one token row and 16 outputs over 4. The tiles' uint8 column
// quads are already AMX's B layout: kGroup / 4 quad rows of 16 outputs x 4
// bytes, 4 * kTile bytes apart. Linux hands out AMX's register state only to a
// process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM), once; where that
// fails (an old kernel, a hypervisor without it) the VNNI path serves.
bool AmxPermitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}

// The tile registers for M token rows: 0 a group of the token rows (M x
// kGroup bytes), 1 and 2 a group's weights for outputs 0-15 and 16-31 (kGroup
// / 4 quad rows of 64 bytes), 3 and 4 their integer sums (M x 16 int32).
template <int M>
void ConfigureTiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  config.rows[0] = M;
  config.colsb[0] = kGroup;
  for (int t : {1, 2}) config.rows[t] = kGroup / 4, config.colsb[t] = 64;
  for (int t : {3, 4}) config.rows[t] = M, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// TileTimesRowsA8 by tile multiplies, with the same integer sums and the same
// float32 operations after them, so the results are the same bits. Needs
// ConfigureTiles<M>() on the calling thread.
template <int M>
inline void TileTimesRowsAmx(const int8_t* xq, int64_t kg, const float* xs, const int32_t* xoff, const uint8_t* w,
                             float (*tot)[kTile]) {
  const int64_t groups = kg / kGroup;
  alignas(64) int32_t sums[2][M][16];
  __m512 facc[M][2];
  for (int r = 0; r < M; ++r) facc[r][0] = facc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * kGroup * kTile;
    Prefetch(wg, kGroup * kTile / 64);
    _tile_zero(3);
    _tile_zero(4);
    _tile_loadd(0, xq + g * kGroup, kg);
    _tile_loadd(1, wg, 4 * kTile);
    _tile_loadd(2, wg + 64, 4 * kTile);
    _tile_dpbsud(3, 0, 1);
    _tile_dpbsud(4, 0, 2);
    _tile_stored(3, sums[0], 64);
    _tile_stored(4, sums[1], 64);
    for (int r = 0; r < M; ++r) {
      const __m512 sx = _mm512_set1_ps(xs[r * groups + g]);
      const __m512i off = _mm512_set1_epi32(xoff[r * groups + g]);
      for (int h = 0; h < 2; ++h) {
        const __m512i acc = _mm512_add_epi32(off, _mm512_load_si512(sums[h][r]));
        facc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sx, facc[r][h]);
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    _mm512_storeu_ps(tot[r], facc[r][0]);
    _mm512_storeu_ps(tot[r] + 16, facc[r][1]);
  }
}
#endif

// Whether this process's 8-bit products of kAmxMinRows rows or more run on AMX.
inline bool AmxServes() {
#if MDLM_JAX_AMX
  return AmxPermitted();
#else
  return false;
#endif
}

// Low-rank adapters of one weight's output rows: u = x @ A for every token
// row (float32, [m, P * r]), the [rank, n] rows of b (output j's column of
// its adapter's b, times the scale, at [t, j]), adapter p acting on output
// rows [ends[p - 1], ends[p]), and the token rows' weights (0: the adapters
// skip a row).
struct Adapters {
  const float* u;
  const float* b;        // float32 adapters, or
  const uint16_t* b16;   // bfloat16 ones (the other is null)
  const int32_t* ends;
  int64_t parts;
  int64_t rank;
  int64_t n;
  const float* rows;
};

// tot[r][o] = sum_i xq[r, i] * w[o, i] for the M token rows and the kTile
// output rows of one tile (`pairs` column pairs), exactly. With VNNI one
// vpdpwssd multiplies 16 output rows' weight pairs by one token row's pair
// (broadcast), so no sum is ever reduced across a register (the [out, in]
// formulation spent a third of its instructions on those reductions).
template <int M>
inline void TileTimesRows(const int16_t* xq, int64_t kp, const int8_t* w, int64_t pairs, int64_t (*tot)[kTile]) {
  for (int r = 0; r < M; ++r)
    for (int64_t o = 0; o < kTile; ++o) tot[r][o] = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  for (int64_t c0 = 0; c0 < pairs; c0 += kPairChunk) {
    const int64_t c1 = std::min(pairs, c0 + kPairChunk);
    __m512i acc[M][2];
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t i = c0; i < c1; ++i) {
      const int8_t* wi = w + i * 2 * kTile;
      Prefetch(wi, 1);
      const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi)));
      const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi + kTile)));
      for (int r = 0; r < M; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq + r * kp + 2 * i, sizeof(pair));
        const __m512i xb = _mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], w0, xb);
        acc[r][1] = _mm512_dpwssd_epi32(acc[r][1], w1, xb);
      }
    }
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m512i a = acc[r][h];
        int64_t* t = tot[r] + 16 * h;
        _mm512_storeu_si512(t, _mm512_add_epi64(_mm512_loadu_si512(t),
                                                _mm512_cvtepi32_epi64(_mm512_castsi512_si256(a))));
        _mm512_storeu_si512(t + 8, _mm512_add_epi64(_mm512_loadu_si512(t + 8),
                                                    _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(a, 1))));
      }
  }
#else
  for (int r = 0; r < M; ++r) {
    const int16_t* xr = xq + r * kp;
    for (int64_t c0 = 0; c0 < pairs; c0 += kPairChunk) {
      const int64_t c1 = std::min(pairs, c0 + kPairChunk);
      int32_t acc[kTile] = {0};
      for (int64_t i = c0; i < c1; ++i) {
        const int8_t* wi = w + i * 2 * kTile;
        const int32_t x0 = xr[2 * i], x1 = xr[2 * i + 1];
#pragma omp simd
        for (int64_t o = 0; o < kTile; ++o) acc[o] += x0 * int32_t(wi[2 * o]) + x1 * int32_t(wi[2 * o + 1]);
      }
      for (int64_t o = 0; o < kTile; ++o) tot[r][o] += acc[o];
    }
  }
#endif
}

// y[o] = sums[o] * sx * scale[o] for the `width` outputs of one token row in
// a tile (`sums` holds kTile), in double as the exact sums need, eight
// outputs an instruction: one at a time this epilogue was a third of the
// instructions of a 576-column tile at eight token rows.
inline void Finish(const int64_t* sums, double sx, const float* scale, int64_t width, float* y) {
  int64_t o = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const __m512d vx = _mm512_set1_pd(sx);
  for (; o < width; o += 8) {
    const __mmask8 mask = width - o >= 8 ? 0xff : static_cast<__mmask8>((1u << (width - o)) - 1);
    const __m512d total = _mm512_cvtepi64_pd(_mm512_loadu_si512(sums + o));
    const __m512d sc = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(mask, scale + o));
    _mm256_mask_storeu_ps(y + o, mask, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(total, vx), sc)));
  }
#endif
  for (; o < width; ++o) y[o] = static_cast<float>(static_cast<double>(sums[o]) * sx * scale[o]);
}

// A bfloat16's float32 value (its bits are float32's top half).
inline float Bf16(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX512F__)
// Sixteen of b's values from `at` on (those `mask` keeps), as float32.
inline __m512 LoadB(const Adapters& ad, int64_t at, __mmask16 mask) {
  if (ad.b != nullptr) return _mm512_maskz_loadu_ps(mask, ad.b + at);
  const __m256i h = _mm256_maskz_loadu_epi16(mask, ad.b16 + at);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// y[o] += rows[r] * sum_t u[r, p * rank + t] * b[t, j0 + o] for the `width`
// outputs from j0 of token row r, p the adapter of output j0 + o: sixteen
// outputs of one adapter at a time (the outputs run along b's rows), one
// output at a time where a run of sixteen spans two adapters.
inline void AddAdapters(const Adapters& ad, int64_t r, int64_t j0, int64_t width, float* y) {
  const float weight = ad.rows[r];
  const float* u = ad.u + r * ad.parts * ad.rank;
  int64_t part = 0, o = 0;
  auto advance = [&](int64_t j) {
    while (part + 1 < ad.parts && j >= ad.ends[part]) ++part;
  };
#if defined(__AVX512F__)
  for (; o < width; o += 16) {
    const int64_t len = std::min<int64_t>(16, width - o), j = j0 + o;
    advance(j);
    if (part + 1 < ad.parts && j + len > ad.ends[part]) break;
    const __mmask16 mask = len == 16 ? 0xffff : static_cast<__mmask16>((1u << len) - 1);
    const float* up = u + part * ad.rank;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t t = 0; t < ad.rank; ++t)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(up[t]), LoadB(ad, t * ad.n + j, mask), acc);
    const __m512 before = _mm512_maskz_loadu_ps(mask, y + o);
    _mm512_mask_storeu_ps(y + o, mask, _mm512_fmadd_ps(_mm512_set1_ps(weight), acc, before));
  }
#endif
  for (; o < width; ++o) {
    const int64_t j = j0 + o;
    advance(j);
    const float* up = u + part * ad.rank;
    float acc = 0.f;
    for (int64_t t = 0; t < ad.rank; ++t) acc += up[t] * (ad.b ? ad.b[t * ad.n + j] : Bf16(ad.b16[t * ad.n + j]));
    y[o] += weight * acc;
  }
}

// Tiles [t0, t1) for the M token rows from m0 on.
template <int M>
void RowsTimesTiles(const int16_t* xq, const float* xs, const int8_t* tiles, const float* scale, const Adapters* ad,
                    float* y, int64_t m0, int64_t kp, int64_t n, int64_t t0, int64_t t1) {
  const int64_t pairs = kp / 2;
  for (int64_t t = t0; t < t1; ++t) {
    int64_t tot[M][kTile];
    TileTimesRows<M>(xq + m0 * kp, kp, tiles + t * pairs * 2 * kTile, pairs, tot);
    const int64_t j0 = t * kTile, width = std::min(kTile, n - j0);
    for (int r = 0; r < M; ++r) {
      float* yr = y + (m0 + r) * n + j0;
      Finish(tot[r], xs[m0 + r], scale + j0, width, yr);
      if (ad != nullptr && ad->rows[m0 + r] != 0.f) AddAdapters(*ad, m0 + r, j0, width, yr);
    }
  }
}

using Block = void (*)(const int16_t*, const float*, const int8_t*, const float*, const Adapters*, float*, int64_t,
                       int64_t, int64_t, int64_t, int64_t);
// Eight token rows keep 16 sums in registers; more rows read the weights again.
constexpr int kMaxBlock = 8;
constexpr Block kBlocks[kMaxBlock] = {RowsTimesTiles<1>, RowsTimesTiles<2>, RowsTimesTiles<3>, RowsTimesTiles<4>,
                                      RowsTimesTiles<5>, RowsTimesTiles<6>, RowsTimesTiles<7>, RowsTimesTiles<8>};

// From this many token rows the rounding of the rows is split over the
// threads too: one thread rounding a prefill's rows left the other idle
// (SmolLM2's 80-row products: about 2.6 ms of rounding a pass of 121 calls).
constexpr int64_t kParallelRoundingRows = 16;

// round(r0, rows) over all m token rows: on the calling thread for a few
// rows, in chunks of rows over the pool for many. Each row is rounded alone,
// so the split does not change a bit.
template <typename Fn>
void RoundRows(ffi::ThreadPool& pool, int64_t m, Fn round) {
  if (m < kParallelRoundingRows) return round(0, m);
  const int64_t per = 8, chunks = (m + per - 1) / per;
  ForEachChunk(pool, chunks, [&](int64_t c) { round(c * per, std::min<int64_t>(per, m - c * per)); });
}

// Rows past one block read each tile again. A prefill's blocks once each
// read every weight from memory (64 rows: eight reads of SmolLM2's 135 MB);
// now every block runs over a run of tiles of about kRunBytes while it sits
// in the core's L2 cache, before the next run. On a Zen 4 the VNNI products
// of up to a few hundred rows were bound by their arithmetic either way; at
// 1,024 rows SmolLM2's layers took 536 -> 478 ms (docs/weight-layouts.md).
constexpr int64_t kRunBytes = 64 * 1024;

// fn(m0, rows, t0, t1) for the blocks of at most `block` token rows, each
// over every tile of `tile_bytes`: a few chunks of tiles a thread, for
// balance, and in each chunk the blocks over one run of tiles at a time.
template <typename Fn>
void ForTiles(ffi::ThreadPool& pool, int64_t m, int64_t n, int64_t block, int64_t tile_bytes, Fn fn) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t count = (n + kTile - 1) / kTile;
  const int64_t per = std::max<int64_t>(1, (count + 4 * threads - 1) / (4 * threads));
  const int64_t chunks = (count + per - 1) / per;
  const int64_t run = m <= block ? per : std::max<int64_t>(1, kRunBytes / tile_bytes);
  ForEachChunk(pool, chunks, [&](int64_t c) {
    const int64_t t0 = c * per, t1 = std::min(count, t0 + per);
    for (int64_t r0 = t0; r0 < t1; r0 += run)
      for (int64_t m0 = 0; m0 < m; m0 += block) fn(m0, std::min<int64_t>(m - m0, block), r0, std::min(t1, r0 + run));
  });
}

ffi::Error Multiply(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k, const int8_t* tiles,
                    const float* scale, int64_t n, const Adapters* ad, float* y) {
  const int64_t kp = (k + kPad - 1) / kPad * kPad;
  std::vector<int16_t> xq(m * kp);
  std::vector<float> xs(m);
  RoundRows(pool, m, [&](int64_t r0, int64_t rows) {
    QuantizeRows(x + r0 * k, rows, k, kp, xq.data() + r0 * kp, xs.data() + r0);
  });
  ForTiles(pool, m, n, kMaxBlock, kp * kTile, [&](int64_t m0, int64_t rows, int64_t t0, int64_t t1) {
    kBlocks[rows - 1](xq.data(), xs.data(), tiles, scale, ad, y, m0, kp, n, t0, t1);
  });
  return ffi::Error::Success();
}

// Tiles [t0, t1) for the M token rows from m0 on, with 8-bit token rows.
template <int M>
void RowsTimesTilesA8(const int8_t* xq, const float* xs, const int32_t* xoff, const uint8_t* tiles,
                      const float* scale, const Adapters* ad, float* y, int64_t m0, int64_t kg, int64_t n, int64_t t0,
                      int64_t t1) {
  const int64_t groups = kg / kGroup;
#if MDLM_JAX_AMX
  const bool amx = M >= kAmxMinRows && AmxServes();
  if (amx) ConfigureTiles<M>();
#endif
  for (int64_t t = t0; t < t1; ++t) {
    float tot[M][kTile];
#if MDLM_JAX_AMX
    if (amx) {
      TileTimesRowsAmx<M>(xq + m0 * kg, kg, xs + m0 * groups, xoff + m0 * groups, tiles + t * kg * kTile, tot);
    } else
#endif
      TileTimesRowsA8<M>(xq + m0 * kg, kg, xs + m0 * groups, xoff + m0 * groups, tiles + t * kg * kTile, tot);
    const int64_t j0 = t * kTile, width = std::min(kTile, n - j0);
    for (int r = 0; r < M; ++r) {
      float* yr = y + (m0 + r) * n + j0;
      for (int64_t o = 0; o < width; ++o) yr[o] = tot[r][o] * scale[j0 + o];
      if (ad != nullptr && ad->rows[m0 + r] != 0.f) AddAdapters(*ad, m0 + r, j0, width, yr);
    }
  }
#if MDLM_JAX_AMX
  if (amx) _tile_release();
#endif
}

using BlockA8 = void (*)(const int8_t*, const float*, const int32_t*, const uint8_t*, const float*, const Adapters*,
                         float*, int64_t, int64_t, int64_t, int64_t, int64_t);
// AMX tiles hold 16 token rows: a block of up to 16 reads the weights once
// (eight rows' sums are all the vector registers hold on the VNNI path).
constexpr int kMaxBlockAmx = 16;
constexpr BlockA8 kBlocksA8[kMaxBlockAmx] = {
    RowsTimesTilesA8<1>,  RowsTimesTilesA8<2>,  RowsTimesTilesA8<3>,  RowsTimesTilesA8<4>,
    RowsTimesTilesA8<5>,  RowsTimesTilesA8<6>,  RowsTimesTilesA8<7>,  RowsTimesTilesA8<8>,
    RowsTimesTilesA8<9>,  RowsTimesTilesA8<10>, RowsTimesTilesA8<11>, RowsTimesTilesA8<12>,
    RowsTimesTilesA8<13>, RowsTimesTilesA8<14>, RowsTimesTilesA8<15>, RowsTimesTilesA8<16>};

ffi::Error MultiplyA8(ffi::ThreadPool& pool, const float* x, int64_t m, int64_t k, const uint8_t* tiles,
                      const float* scale, int64_t n, const Adapters* ad, float* y) {
  const int64_t kg = (k + kGroup - 1) / kGroup * kGroup, groups = kg / kGroup;
  std::vector<int8_t> xq(m * kg);
  std::vector<float> xs(m * groups);
  std::vector<int32_t> xoff(m * groups);
  RoundRows(pool, m, [&](int64_t r0, int64_t rows) {
    QuantizeRowsA8(x + r0 * k, rows, k, kg, xq.data() + r0 * kg, xs.data() + r0 * groups, xoff.data() + r0 * groups);
  });
  const int64_t block = AmxServes() ? kMaxBlockAmx : kMaxBlock;
  ForTiles(pool, m, n, block, kg * kTile, [&](int64_t m0, int64_t rows, int64_t t0, int64_t t1) {
    kBlocksA8[rows - 1](xq.data(), xs.data(), xoff.data(), tiles, scale, ad, y, m0, kg, n, t0, t1);
  });
  return ffi::Error::Success();
}

// One layer's part of an operand: the operand itself ([rank] dimensions,
// layer 0), or layer `layer` of one that holds every layer's along a leading
// axis ([layers, rank...]): the decoding copy stacks each kind of weight so
// that a pass hands XLA a few dozen operands, not a thousand (dispatch cost
// grows with their count), and each call reads its layer in place.
struct Layer {
  const void* data = nullptr;
  ffi::Span<const int64_t> dims;
  int64_t count = 0;  // elements of one layer

  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data);
  }
};

bool LayerOf(const void* data, size_t element_bytes, ffi::Span<const int64_t> dims, size_t rank, int64_t layer,
             Layer& out) {
  const bool stacked = dims.size() == rank + 1;
  if (!(dims.size() == rank && layer == 0) && !(stacked && layer >= 0 && layer < dims[0])) return false;
  out.dims = dims.last(rank);
  out.count = 1;
  for (int64_t d : out.dims) out.count *= d;
  out.data = static_cast<const char*>(data) + (stacked ? layer * out.count * element_bytes : 0);
  return true;
}

// x [m, k], tiles [ceil(n / kTile), kp / kWide, kTile, kWide] with the
// columns padded to kp (int16 rows: pairs, kp a multiple of kPad; 8-bit rows:
// quads, kp a multiple of kGroup), scale [n].
bool WantTiles(ffi::Buffer<ffi::F32>& x, const Layer& tiles, const Layer& scale, int64_t wide, int64_t pad) {
  auto xd = x.dimensions();
  auto td = tiles.dims;
  const int64_t n = scale.count;
  return xd.size() == 2 && td[0] == (n + kTile - 1) / kTile && td[1] == (xd[1] + pad - 1) / pad * pad / wide &&
         td[2] == kTile && td[3] == wide;
}

// The adapters' operands of a call: at [parts * rank, k], b [rank, n], ends
// [parts] (each maybe one layer of a stack, as the weight's), rows [m]; at and
// b float32, or bfloat16 with `bf16`.
struct AdapterOperands {
  const void* at;
  ffi::Span<const int64_t> at_dims;
  const void* b;
  ffi::Span<const int64_t> b_dims;
  bool bf16;
  ffi::Buffer<ffi::S32>& ends;
  ffi::Buffer<ffi::F32>& rows;
};

// The adapters' operands checked, and u = x @ A [m, parts * rank] for the
// token rows they act on (zeros elsewhere).
ffi::Error AdapterInputs(ffi::Buffer<ffi::F32>& x, int64_t n, const AdapterOperands& op, int64_t layer,
                         std::vector<float>& u, Adapters& ad) {
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1];
  const size_t width = op.bf16 ? 2 : 4;
  Layer at, b, ends;
  const bool fits = LayerOf(op.at, width, op.at_dims, 2, layer, at) && LayerOf(op.b, width, op.b_dims, 2, layer, b) &&
                    LayerOf(op.ends.typed_data(), 4, op.ends.dimensions(), 1, layer, ends);
  const int64_t parts = fits ? ends.count : 0;
  if (!fits || parts < 1 || at.dims[1] != k || b.dims[1] != n || at.dims[0] != parts * b.dims[0] ||
      op.rows.element_count() != m) {
    return ffi::Error::InvalidArgument(
        "int8_lora_matmul: want at [parts * rank, k], b [rank, n], ends [parts] (each maybe layer `layer` of a"
        " stack) and rows [m]");
  }
  const int64_t rank = b.dims[0];
  u.assign(m * parts * rank, 0.f);
  const float* xp = x.typed_data();
  const float* ap = op.bf16 ? nullptr : at.as<float>();
  const uint16_t* ap16 = op.bf16 ? at.as<uint16_t>() : nullptr;
  const float* rp = op.rows.typed_data();
  for (int64_t r = 0; r < m; ++r) {
    if (rp[r] == 0.f) continue;
    for (int64_t c = 0; c < parts * rank; ++c) {
      float acc = 0.f;
      if (ap != nullptr) {
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < k; ++i) acc += xp[r * k + i] * ap[c * k + i];
      } else {
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 vacc = _mm512_setzero_ps();
        for (; i + 16 <= k; i += 16) {
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ap16 + c * k + i));
          const __m512 av = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
          vacc = _mm512_fmadd_ps(_mm512_loadu_ps(xp + r * k + i), av, vacc);
        }
        acc = _mm512_reduce_add_ps(vacc);
#endif
        for (; i < k; ++i) acc += xp[r * k + i] * Bf16(ap16[c * k + i]);
      }
      u[r * parts * rank + c] = acc;
    }
  }
  ad = Adapters{u.data(), op.bf16 ? nullptr : b.as<float>(), op.bf16 ? b.as<uint16_t>() : nullptr,
                ends.as<int32_t>(), parts, rank, n, rp};
  return ffi::Error::Success();
}

// One call of either kernel (kA8: 8-bit token rows) on layer `layer` of its
// weight's operands, with adapters when `adapters` is given: its operands
// checked, then the product.
template <bool kA8, typename Tiles>
ffi::Error Product(const char* name, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, Tiles& tiles_op,
                   ffi::Buffer<ffi::F32>& scale_op, const AdapterOperands* adapters, int64_t layer, float* y) {
  Layer tiles, scale;
  if (!LayerOf(tiles_op.typed_data(), 1, tiles_op.dimensions(), 4, layer, tiles) ||
      !LayerOf(scale_op.typed_data(), 4, scale_op.dimensions(), 1, layer, scale) ||
      !WantTiles(x, tiles, scale, kA8 ? 4 : 2, kA8 ? kGroup : kPad)) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": want x [m, k], scale [n] and the tiles of an [n, k] weight (each maybe"
                                       " layer `layer` of a stack)");
  }
  const int64_t m = x.dimensions()[0], k = x.dimensions()[1], n = scale.count;
  std::vector<float> u;
  Adapters ad;
  if (adapters != nullptr) {
    if (auto e = AdapterInputs(x, n, *adapters, layer, u, ad); e.failure()) return e;
  }
  const Adapters* adp = adapters != nullptr ? &ad : nullptr;
  if constexpr (kA8) {
    return MultiplyA8(pool, x.typed_data(), m, k, tiles.as<uint8_t>(), scale.as<float>(), n, adp, y);
  } else {
    return Multiply(pool, x.typed_data(), m, k, tiles.as<int8_t>(), scale.as<float>(), n, adp, y);
  }
}

}  // namespace

// Whether this build has the kernels' vector paths (AVX-512 with VNNI). Built
// without them (`-march=native` on an AVX2 CPU) the portable loops run: the
// same values, but slower than XLA's float32 on the same CPU.
extern "C" int CpuKernelsVectorized() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return 1;
#else
  return 0;
#endif
}

// Whether the 8-bit products of eight token rows or more run on AMX: built for
// it (`-march=native` on a CPU with AMX-INT8) and granted it by the kernel.
extern "C" int Int8ProductsUseAmx() {
  return AmxServes() ? 1 : 0;
}

// The four handlers' bodies: int16 or 8-bit token rows (the tiles' dtype
// says which), without or with adapters.
template <bool kA8, ffi::DataType kTiles>
ffi::Error PlainProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kTiles> tiles,
                        ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  return Product<kA8>(kA8 ? "int8_a8_matmul" : "int8_matmul", pool, x, tiles, scale, nullptr, layer,
                      y->typed_data());
}

template <bool kA8, ffi::DataType kTiles, ffi::DataType kAdapters>
ffi::Error AdaptedProduct(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<kTiles> tiles,
                          ffi::Buffer<ffi::F32> scale, ffi::Buffer<kAdapters> at, ffi::Buffer<kAdapters> b,
                          ffi::Buffer<ffi::S32> ends, ffi::Buffer<ffi::F32> rows, ffi::ResultBuffer<ffi::F32> y,
                          int64_t layer) {
  const AdapterOperands adapters{at.typed_data(), at.dimensions(), b.typed_data(), b.dimensions(),
                                 kAdapters == ffi::BF16, ends, rows};
  return Product<kA8>(kA8 ? "int8_a8_lora_matmul" : "int8_lora_matmul", pool, x, tiles, scale, &adapters, layer,
                      y->typed_data());
}

#define MDLM_JAX_PRODUCT(name, impl, tile_type)                                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                                                                  \
                                ffi::Ffi::Bind()                                                             \
                                    .Ctx<ffi::ThreadPool>()                                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                            \
                                    .Arg<ffi::Buffer<tile_type>>()                                           \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                            \
                                    .Ret<ffi::Buffer<ffi::F32>>()                                            \
                                    .Attr<int64_t>("layer"));
#define MDLM_JAX_LORA_PRODUCT(name, impl, tile_type, adapter_type)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                                                                  \
                                ffi::Ffi::Bind()                                                             \
                                    .Ctx<ffi::ThreadPool>()                                                  \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                            \
                                    .Arg<ffi::Buffer<tile_type>>()                                           \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                            \
                                    .Arg<ffi::Buffer<adapter_type>>()                                        \
                                    .Arg<ffi::Buffer<adapter_type>>()                                        \
                                    .Arg<ffi::Buffer<ffi::S32>>()                                            \
                                    .Arg<ffi::Buffer<ffi::F32>>()                                            \
                                    .Ret<ffi::Buffer<ffi::F32>>()                                            \
                                    .Attr<int64_t>("layer"));

MDLM_JAX_PRODUCT(Int8Matmul, (PlainProduct<false, ffi::S8>), ffi::S8)
MDLM_JAX_LORA_PRODUCT(Int8LoraMatmul, (AdaptedProduct<false, ffi::S8, ffi::F32>), ffi::S8, ffi::F32)
MDLM_JAX_LORA_PRODUCT(Int8Bf16LoraMatmul, (AdaptedProduct<false, ffi::S8, ffi::BF16>), ffi::S8, ffi::BF16)
MDLM_JAX_PRODUCT(Int8A8Matmul, (PlainProduct<true, ffi::U8>), ffi::U8)
MDLM_JAX_LORA_PRODUCT(Int8A8LoraMatmul, (AdaptedProduct<true, ffi::U8, ffi::F32>), ffi::U8, ffi::F32)
MDLM_JAX_LORA_PRODUCT(Int8A8Bf16LoraMatmul, (AdaptedProduct<true, ffi::U8, ffi::BF16>), ffi::U8, ffi::BF16)
