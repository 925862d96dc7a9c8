// Attention of a decoding pass's few queries over one layer of the KV cache,
// on CPU, called from JAX through the XLA FFI (kernels/cpu_attention.py).
//
// A decoding pass at batch 1 has one to a few tens of queries and a cache of
// a few hundred filled slots: a few million multiply-adds a layer. Through
// XLA:CPU that took a copy of the layer's keys and values out of the cache
// buffer, then half a dozen small dots and softmax fusions, each an
// operation with its own dispatch (about a fifth of a revising pass of the
// packaged default, measured). Here one call reads the layer in place, up to
// each query's last readable slot only.
//
// The mask is the cache's structural "prefix" mask: query i reads slot j when
// kv_valid[j] and j < q_end[i]. Scores and softmax are float32, as in the
// reference (`kernels.attention_reference`); a query that may read no slot
// gets zeros.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using mdlm_jax::ForEachChunk;

namespace {

// Queries that share a key/value head are scored together, so each key row
// is read once for up to this many of them (a pass of eight columns has 24 a
// head of SmolLM2: one block, where blocks of four reread the keys' strided
// rows six times, most of the kernel's time, profiled). Up to 12 queries take
// 32 slots a step (2 * 12 sums and two rows of keys in the 32 vector
// registers), more take 16.
#if defined(__AVX512F__)
constexpr int64_t kMaxQueries = 24;
#else
// With AVX2's 16 registers: 12 sums, a key row and a query's broadcast.
constexpr int64_t kMaxQueries = 12;
#endif
// Steps of slots between a key row's loads and its prefetch: the keys are
// d rows of the layer's buffer s slots apart, too many streams for the
// hardware prefetcher, and a step's values are prefetched into L2 with its
// keys, so the sums over the values find them there. Six columns over 306
// filled slots of a cache out of L2 took 111 us a layer, one thread, without
// either (with blocks of twelve), 71 with both; 8 steps ahead did no better.
constexpr int64_t kPrefetchSteps = 2;
// The most queries whose values' sums are formed together (`QueriesAtWidth`).
constexpr int kMaxGroup = 8;
// Head dimensions up to 16 * kMaxWidth (a multiple of 16) keep an output row
// in registers while the values are summed.
constexpr int64_t kMaxWidth = 8;

#if defined(__AVX512F__)
// e^x in 16 lanes (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-7
// polynomial in r, then 2^n), a couple of float32 ulps from exp; lanes below
// -87 give 0 as masked scores must.
inline __m512 Exp(__m512 x) {
  const __m512 low = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
  x = _mm512_max_ps(x, low);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}
#endif

#if defined(__AVX512F__)
// o[i] = sum_j p[i][j] * values[j] over lo <= j < end for Q queries (p
// already normalised), their rows of W * 16 outputs in registers (a width
// known at compile time: bounded at run time, the accumulators went through
// memory). Each value row is read once for the Q queries, and their Q * W
// sums are independent chains (one query at a time, each of its W sums waited
// on the last fused multiply-add). Slots not `valid` are skipped; p[i][j] is
// 0 past query i's own end (the values of valid slots are finite, so 0 * v
// adds nothing).
template <int W, int Q>
void SumValues(const float* const* p, int64_t lo, int64_t end, const bool* valid, const float* values,
               float* const* o) {
  __m512 acc[Q][W];
#pragma GCC unroll 16
  for (int i = 0; i < Q; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t j = lo; j < end; ++j) {
    if (!valid[j]) continue;
    const float* v = values + j * W * 16;
    __m512 vc[W];
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c) vc[c] = _mm512_loadu_ps(v + 16 * c);
#pragma GCC unroll 16
    for (int i = 0; i < Q; ++i) {
      const __m512 w = _mm512_set1_ps(p[i][j]);
#pragma GCC unroll 16
      for (int c = 0; c < W; ++c) acc[i][c] = _mm512_fmadd_ps(w, vc[c], acc[i][c]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < Q; ++i)
#pragma GCC unroll 16
    for (int c = 0; c < W; ++c) _mm512_storeu_ps(o[i] + 16 * c, acc[i][c]);
}

// Queries summed together at width W: as many as keep Q * W + W + 1 vectors
// in the 32 registers, at most 8.
constexpr int QueriesAtWidth(int w) { return std::min(kMaxGroup, std::max(1, (28 - w) / w)); }
using SumValuesFn = void (*)(const float* const*, int64_t, int64_t, const bool*, const float*, float* const*);
constexpr SumValuesFn kSumValues[kMaxWidth] = {
    SumValues<1, QueriesAtWidth(1)>, SumValues<2, QueriesAtWidth(2)>, SumValues<3, QueriesAtWidth(3)>,
    SumValues<4, QueriesAtWidth(4)>, SumValues<5, QueriesAtWidth(5)>, SumValues<6, QueriesAtWidth(6)>,
    SumValues<7, QueriesAtWidth(7)>, SumValues<8, QueriesAtWidth(8)>};
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define MDLM_JAX_ATTENTION_AVX2 1
// e^x in 8 lanes, as Exp above (2^n built in the exponent bits: n >= -126
// where x >= -87, so the scaling is exact as scalef's); lanes below -87 give 0.
inline __m256 Exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  const __m256 tiny = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// The lanes of v added in one fixed order.
inline float LaneSum8(__m256 v) {
  return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// Lanes [0, left) of a step of 8 (a maskload's mask).
inline __m256i FirstLanes(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Outputs [c0, c0 + 16) of Q queries into o[i][0, 16), as SumValues: the
// sums of p[i][j] * values[j][c] over the valid slots lo <= j < end, in slot order. Sixteen
// outputs at a time keep 2 * Q sums, two value stretches and a weight in the
// 16 registers, and each value stretch is read once for the Q queries.
template <int Q>
void SumValues16(const float* const* p, int64_t lo, int64_t end, const bool* valid, const float* values, int64_t d,
                 int64_t c0, float* const* o) {
  __m256 acc[Q][2];
  for (int i = 0; i < Q; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t j = lo; j < end; ++j) {
    if (!valid[j]) continue;
    const float* v = values + j * d + c0;
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
    for (int i = 0; i < Q; ++i) {
      const __m256 w = _mm256_broadcast_ss(p[i] + j);
      acc[i][0] = _mm256_fmadd_ps(w, v0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w, v1, acc[i][1]);
    }
  }
  for (int i = 0; i < Q; ++i) {
    _mm256_storeu_ps(o[i], acc[i][0]);
    _mm256_storeu_ps(o[i] + 8, acc[i][1]);
  }
}
constexpr int kGroup16 = 6;  // queries SumValues16 sums together
static_assert(kGroup16 <= kMaxGroup, "the scores' scratch rows cover a group past the last query");
#endif

// Up to Q queries of one key/value head: `q` their rows (d floats each,
// already scaled), `keys` [d, s] and `values` [s, d] of the layer, `ends`
// each query's readable end, `valid` the slots' flags; `out` their output rows.
template <int64_t Q>
void Queries(const float* const* q, int64_t nq, const float* keys, const float* values, const bool* valid,
             const int64_t* ends, int64_t s, int64_t d, float* const* out) {
  constexpr int64_t kQueries = Q;
  int64_t reach = 0;
  for (int64_t i = 0; i < nq; ++i) reach = std::max(reach, ends[i]);
  // Each query's scores, then probabilities, over the slots up to the furthest end.
  // Rows past nq, and up to a whole group of the values' sums past those:
  // scratch for absent queries (the rows past kQueries stay zeros).
  std::vector<float> scores((kQueries + kMaxGroup) * reach);
  // Scores: each row of the keys is read once for all the queries, V * 16
  // slots a step. Every loop over queries runs to the constant kQueries
  // (absent queries read zeros) so that the accumulators stay in registers:
  // bounded by nq they went through memory, 8x slower (measured). The
  // queries' elements sit transposed in one array, [d, kQueries]: through a
  // pointer a query, the compiler kept the pointers in vector registers and
  // moved each out to a general register every step.
  int64_t j = 0;
#if defined(__AVX512F__)
  constexpr int V = kQueries <= 12 ? 2 : 1;
  constexpr int64_t kStep = 16 * V;
  std::vector<float> qt(d * kQueries, 0.f);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t c = 0; c < d; ++c) qt[c * kQueries + i] = q[i][c];
  for (int64_t c = 0; c < d; ++c)
    for (int64_t a = 0; a < std::min(reach, kStep * kPrefetchSteps); a += 16)
      _mm_prefetch(reinterpret_cast<const char*>(keys + c * s + a), _MM_HINT_T0);
  for (; j < reach; j += kStep) {
    __mmask16 mask[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      const int64_t left = reach - j - 16 * v;
      mask[v] = left >= 16 ? 0xffff : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : 0;
    }
    __m512 acc[kQueries][V];
#pragma GCC unroll 32
    for (int64_t i = 0; i < kQueries; ++i)
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const float* row = keys + c * s + j;
      const float* qc = qt.data() + c * kQueries;
      __m512 k[V];
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(row + kStep * kPrefetchSteps + 16 * v), _MM_HINT_T0);
        // The step's values, a line for each key row read: V * 16 slots of d floats.
        _mm_prefetch(reinterpret_cast<const char*>(values + j * d + 16 * (c * V + v)), _MM_HINT_T1);
        k[v] = _mm512_maskz_loadu_ps(mask[v], row + 16 * v);
      }
#pragma GCC unroll 32
      for (int64_t i = 0; i < kQueries; ++i) {
        const __m512 qb = _mm512_set1_ps(qc[i]);
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(qb, k[v], acc[i][v]);
      }
    }
#pragma GCC unroll 32
    for (int64_t i = 0; i < kQueries; ++i)
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(scores.data() + i * reach + j + 16 * v, mask[v], acc[i][v]);
  }
#elif defined(MDLM_JAX_ATTENTION_AVX2)
  // As above with 8 slots a step and one key row in a register.
  std::vector<float> qt(d * kQueries, 0.f);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t c = 0; c < d; ++c) qt[c * kQueries + i] = q[i][c];
  for (int64_t c = 0; c < d; ++c)
    for (int64_t a = 0; a < std::min<int64_t>(reach, 16 * kPrefetchSteps); a += 16)
      _mm_prefetch(reinterpret_cast<const char*>(keys + c * s + a), _MM_HINT_T0);
  for (; j < reach; j += 8) {
    const __m256i mask = FirstLanes(reach - j);
    __m256 acc[kQueries];
    for (int64_t i = 0; i < kQueries; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; ++c) {
      const float* row = keys + c * s + j;
      const float* qc = qt.data() + c * kQueries;
      if (j % 16 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(row + 16 * kPrefetchSteps), _MM_HINT_T0);
        // The next two steps' values, a line for each key row read: 16 slots of d floats.
        _mm_prefetch(reinterpret_cast<const char*>(values + j * d + 16 * c), _MM_HINT_T1);
      }
      const __m256 k = _mm256_maskload_ps(row, mask);
      for (int64_t i = 0; i < kQueries; ++i) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(qc + i), k, acc[i]);
    }
    for (int64_t i = 0; i < kQueries; ++i) _mm256_maskstore_ps(scores.data() + i * reach + j, mask, acc[i]);
  }
#else
  for (int64_t i = 0; i < nq; ++i)
    for (j = 0; j < reach; ++j) {
      float acc = 0.f;
      for (int64_t c = 0; c < d; ++c) acc += q[i][c] * keys[c * s + j];
      scores[i * reach + j] = acc;
    }
#endif
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  // The sums over slots run in 16-slot steps from the first valid slot, so a
  // query's total is the same bits wherever its slots sit in the buffer (a
  // prompt left-padded by the AR path or at slot 0 in the engine): int8
  // decoding rounds token rows, and ulps apart there become other tokens.
  int64_t lo = 0;
  while (lo < reach && !valid[lo]) ++lo;
  // Each query's probabilities (unnormalised; 0 past its end and on masked
  // slots) and the reciprocal of their total, 0 for a query that reads nothing.
  float inv[kQueries] = {0.f};
  for (int64_t i = 0; i < kQueries; ++i) {
    float* row = scores.data() + i * reach;
    if (i >= nq) {  // an absent query: probabilities of zero, never read back
      std::fill(row, row + reach, 0.f);
      continue;
    }
    float top = kMasked;
    j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // Masked slots set to -inf and the largest score found, 16 slots an
    // instruction (one at a time, each maximum waited on the last).
    __m512 tops = _mm512_set1_ps(kMasked);
    const __m512 masked = _mm512_set1_ps(kMasked);
    for (; j + 16 <= ends[i]; j += 16) {
      const __mmask16 ok = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(valid + j)),
                                              _mm_set1_epi8(1));
      const __m512 v = _mm512_mask_blend_ps(ok, masked, _mm512_loadu_ps(row + j));
      _mm512_storeu_ps(row + j, v);
      tops = _mm512_max_ps(tops, v);
    }
    top = _mm512_reduce_max_ps(tops);
#elif defined(MDLM_JAX_ATTENTION_AVX2)
    __m256 tops = _mm256_set1_ps(kMasked);
    const __m256 masked = _mm256_set1_ps(kMasked);
    for (; j + 8 <= ends[i]; j += 8) {
      const __m256i flags = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(valid + j)));
      const __m256 ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(flags, _mm256_setzero_si256()));
      const __m256 v = _mm256_blendv_ps(masked, _mm256_loadu_ps(row + j), ok);
      _mm256_storeu_ps(row + j, v);
      tops = _mm256_max_ps(tops, v);
    }
    for (int a = 0; a < 8; ++a) top = std::max(top, tops[a]);
#endif
    for (; j < ends[i]; ++j) {
      if (!valid[j]) row[j] = kMasked;
      top = std::max(top, row[j]);
    }
    std::fill(row + ends[i], row + reach, 0.f);
    if (top == kMasked) {  // nothing to read
      std::fill(row, row + ends[i], 0.f);
      continue;
    }
    float total = 0.f;
    std::fill(row, row + lo, 0.f);  // masked: before the first valid slot
    j = lo;
#if defined(__AVX512F__)
    const __m512 shift = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (; j + 16 <= ends[i]; j += 16) {
      const __m512 e = Exp(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
      _mm512_storeu_ps(row + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#elif defined(MDLM_JAX_ATTENTION_AVX2)
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (; j + 8 <= ends[i]; j += 8) {
      const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
      _mm256_storeu_ps(row + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    total = LaneSum8(sum);
#endif
    for (; j < ends[i]; ++j) {
      row[j] = std::exp(row[j] - top);
      total += row[j];
    }
    inv[i] = 1.f / total;
    for (j = lo; j < ends[i]; ++j) row[j] *= inv[i];
  }
#if defined(__AVX512F__)
  if (d % 16 == 0 && d <= 16 * kMaxWidth) {
    // Outputs of absent queries (no allocation a call); their rows are zeros.
    float sink[(kQueries + kMaxGroup) * 16 * kMaxWidth];
    const float* ps[kQueries + kMaxGroup];
    float* os[kQueries + kMaxGroup];
    for (int64_t i = 0; i < kQueries + kMaxGroup; ++i) {
      ps[i] = scores.data() + i * reach;
      os[i] = i < nq ? out[i] : sink + i * d;
    }
    const int width = static_cast<int>(d / 16), group = QueriesAtWidth(width);
    for (int64_t i = 0; i < nq; i += group) kSumValues[width - 1](ps + i, lo, reach, valid, values, os + i);
    return;
  }
#elif defined(MDLM_JAX_ATTENTION_AVX2)
  if (d % 16 == 0) {
    float sink[(kQueries + kMaxGroup) * 16];  // the outputs of absent queries, 16 at a time
    const float* ps[kQueries + kMaxGroup];
    float* os[kQueries + kMaxGroup];
    for (int64_t c0 = 0; c0 < d; c0 += 16) {
      for (int64_t i = 0; i < kQueries + kMaxGroup; ++i) {
        ps[i] = scores.data() + i * reach;
        os[i] = i < nq ? out[i] + c0 : sink + i * 16;
      }
      for (int64_t i = 0; i < nq; i += kGroup16) SumValues16<kGroup16>(ps + i, lo, reach, valid, values, d, c0, os + i);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < nq; ++i) {
    const float* row = scores.data() + i * reach;
    float* o = out[i];
    std::fill(o, o + d, 0.f);
    for (j = 0; j < ends[i]; ++j) {
      if (row[j] == 0.f) continue;
      const float p = row[j];
      const float* v = values + j * d;
      for (int64_t c = 0; c < d; ++c) o[c] += p * v[c];
    }
  }
}

// The block sizes Queries is built for, and the one that holds n queries.
constexpr int64_t kBlockSizes[] = {2, 4, 6, 8, 10, 12, 15, 18, 21, 24};
using QueriesFn = void (*)(const float* const*, int64_t, const float*, const float*, const bool*, const int64_t*,
                           int64_t, int64_t, float* const*);
constexpr QueriesFn kQueriesFns[] = {Queries<2>,  Queries<4>,  Queries<6>,  Queries<8>,  Queries<10>,
                                     Queries<12>, Queries<15>, Queries<18>, Queries<21>, Queries<24>};
static_assert(kBlockSizes[5] == 12 && kBlockSizes[9] == 24, "blocks end at each vector width's kMaxQueries");
inline QueriesFn QueriesFor(int64_t n) {
  int k = 0;
  while (kBlockSizes[k] < n) ++k;
  return kQueriesFns[k];
}

}  // namespace

// q [b, l, h, d]; keys [n, B, g, d, s] and values [n, B, g, s, d], every
// layer's buffer, of which `layer` and the first b rows are read; q_end
// [b, l]; kv_valid [b, s]; out [b, l, h, d].
static ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                                     ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> q_end,
                                     ffi::Buffer<ffi::PRED> kv_valid, ffi::ResultBuffer<ffi::F32> out, int64_t layer,
                                     float scale) {
  auto qd = q.dimensions();
  auto kd = keys.dimensions();
  auto vd = values.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || vd.size() != 5) {
    return ffi::Error::InvalidArgument("cache_attention: want q [b, l, h, d] and [n, B, g, ...] key/value buffers");
  }
  const int64_t b = qd[0], l = qd[1], h = qd[2], d = qd[3];
  const int64_t n = kd[0], rows = kd[1], g = kd[2], s = kd[4];
  if (kd[3] != d || vd[0] != n || vd[1] != rows || vd[2] != g || vd[3] != s || vd[4] != d || rows < b ||
      g < 1 || h % g || layer < 0 || layer >= n || q_end.element_count() != b * l ||
      kv_valid.element_count() != b * s) {
    return ffi::Error::InvalidArgument(
        "cache_attention: want keys [n, B >= b, g, d, s], values [n, B, g, s, d], h a multiple of g, a layer in"
        " [0, n), q_end [b, l] and kv_valid [b, s]");
  }
  // Each head's queries in the fewest blocks of at most kMaxQueries, evened out.
  const int64_t per_group = h / g, queries = l * per_group;
  const int64_t blocks = (queries + kMaxQueries - 1) / kMaxQueries;
  const int64_t per_block = (queries + blocks - 1) / blocks;
  const QueriesFn queries_fn = QueriesFor(per_block);
  const float* qp = q.typed_data();
  const float* kp = keys.typed_data() + layer * rows * g * d * s;
  const float* vp = values.typed_data() + layer * rows * g * s * d;
  const int32_t* ends = q_end.typed_data();
  const bool* valid = kv_valid.typed_data();
  float* op = out->typed_data();
  // Scaled query rows, [b, l, h, d].
  std::vector<float> scaled(b * l * h * d);
  for (int64_t i = 0; i < b * l * h * d; ++i) scaled[i] = qp[i] * scale;
  ForEachChunk(pool, b * g * blocks, [&](int64_t item) {
    const int64_t row = item / (g * blocks), group = item / blocks % g, block = item % blocks;
    const float* qs[kMaxQueries];
    float* os[kMaxQueries];
    int64_t reach[kMaxQueries];
    const int64_t first = block * per_block, nq = std::min(per_block, queries - first);
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t query = (first + i) / per_group, head = group * per_group + (first + i) % per_group;
      const int64_t at = ((row * l + query) * h + head) * d;
      qs[i] = scaled.data() + at;
      os[i] = op + at;
      reach[i] = std::clamp<int64_t>(ends[row * l + query], 0, s);
    }
    queries_fn(qs, nq, kp + (row * g + group) * d * s, vp + (row * g + group) * s * d, valid + row * s, reach, s, d, os);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<float>("scale"));

// Whether this build vectorizes the attention (AVX-512, or AVX2 with FMA):
// elsewhere XLA's dots serve, faster than the portable loops.
extern "C" int CacheAttentionVectorized() {
#if defined(__AVX512F__) || defined(MDLM_JAX_ATTENTION_AVX2)
  return 1;
#else
  return 0;
#endif
}
