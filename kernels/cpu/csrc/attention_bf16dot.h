// The wide (prefill) work item for a bfloat16 cache on a CPU with AVX512-BF16 dot products
// (`vdpbf16ps`: 16 lanes of fp32 += a pair of bf16 products each): attention_simd.h's wide_item
// with both products in bf16 pairs, half the instructions of the float32 body.
//
//   scores   sT[j][rows] = scale * sum_d K[j][d] q[rows][d]: the query pairs (q[2i], q[2i+1])
//            of a row in one lane, the key's pair broadcast; bf16 products are exact in float32,
//            and the unscaled bf16 query is used (the scale applies to the float32 sums), so the
//            scores are the float32 body's up to the order of the additions.
//   P V      acc[r][d] += sum_j P[r][j] V[j][d]: the value pairs (V[2i][d], V[2i+1][d]) of one d
//            in a lane (two rows interleaved per chunk), the row's probability pair broadcast.
//            P is rounded to bf16 here (as flash attention does on a GPU); the running sums l
//            stay those of the float32 probabilities.
//
// The online softmax (wide_softmax), the masks and the window are attention_simd.h's.
#pragma once

#if defined(DELTASERVE_SIMD) && DELTASERVE_SIMD == 512 && defined(__AVX512BF16__)
#define DELTASERVE_BF16DOT 1

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#include "attention_simd.h"

namespace deltaserve_cpu {
namespace simd {

constexpr int kPairs = kChunk / 2;     // key pairs per chunk

inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// The 32 bits at p (a bf16 pair) in every lane.
inline __m512i bcast_pair(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(static_cast<int>(v));
}

// sT[j + a][..] = scale * (keys[j + a] . q rows) for a < K; qp[i][r] is row r's pair i.
template <int D, int K>
inline void dot_scores_step(const uint32_t (*qp)[kWideRows], const c10::BFloat16* const* keys,
                            int j, float scale, float (*sT)[kWideRows]) {
  __m512 acc[K][kLaneVecs];
  for (int a = 0; a < K; ++a)
    for (int v = 0; v < kLaneVecs; ++v) acc[a][v] = zero();
  for (int i = 0; i < D / 2; ++i) {
    __m512i q[kLaneVecs];
    for (int v = 0; v < kLaneVecs; ++v)
      q[v] = _mm512_load_si512(reinterpret_cast<const void*>(qp[i] + kLanes * v));
    for (int a = 0; a < K; ++a) {
      const __m512i k = bcast_pair(keys[j + a] + 2 * i);
      for (int v = 0; v < kLaneVecs; ++v) acc[a][v] = dot2(acc[a][v], q[v], k);
    }
  }
  const vf s = set1(scale);
  for (int a = 0; a < K; ++a)
    for (int v = 0; v < kLaneVecs; ++v) store(sT[j + a] + kLanes * v, mul(acc[a][v], s));
}

template <int D>
inline void dot_scores(const uint32_t (*qp)[kWideRows], const c10::BFloat16* const* keys, int n,
                       float scale, float (*sT)[kWideRows]) {
  int j = 0;
  for (; j + kKeyStep <= n; j += kKeyStep) dot_scores_step<D, kKeyStep>(qp, keys, j, scale, sT);
  for (; j < n; ++j) dot_scores_step<D, 1>(qp, keys, j, scale, sT);
}

// vp[i][d] = (V[2i][d], V[2i+1][d]) for the chunk's n value rows (missing rows are zeros).
template <int D>
inline void value_pairs(const c10::BFloat16* const* vals, int n, uint32_t (*vp)[D]) {
  // lane 2k of the result takes a's element k, lane 2k + 1 b's (k < 16: one half of 32 d's)
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int i = 0; 2 * i < n; ++i) {
    const int j = 2 * i;
    for (int c = 0; c < D; c += 32) {              // 32 d's a step (16 when D ends there)
      const bool whole = D - c >= 32;
      const __mmask32 m = whole ? ~__mmask32(0) : __mmask32(0xFFFF);
      const __m512i a = _mm512_maskz_loadu_epi16(m, vals[j] + c);
      const __m512i b = j + 1 < n ? _mm512_maskz_loadu_epi16(m, vals[j + 1] + c)
                                  : _mm512_setzero_si512();
      _mm512_storeu_si512(vp[i] + c, _mm512_permutex2var_epi16(a, lo, b));
      if (whole) _mm512_storeu_si512(vp[i] + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// pp[i][r] = (P[r][2i], P[r][2i+1]) as bf16 (sT holds P, rows in lanes); P past n reads as 0.
inline void prob_pairs(const float (*sT)[kWideRows], int n, uint32_t (*pp)[kWideRows]) {
  for (int i = 0; 2 * i < n; ++i) {
    for (int v = 0; v < kLaneVecs; ++v) {
      const __m512 a = load(sT[2 * i] + kLanes * v);
      const __m512 b = 2 * i + 1 < n ? load(sT[2 * i + 1] + kLanes * v) : zero();
      const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a)));
      const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(b)));
      _mm512_store_si512(reinterpret_cast<void*>(pp[i] + kLanes * v),
                         _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// acc[r0 + i] = acc[r0 + i] * alpha + sum over the chunk's pairs, R rows sharing each value load.
template <int D, int R>
inline void dot_pv_pass(float (*acc)[D], int r0, const float* alpha,
                        const uint32_t (*pp)[kWideRows], const uint32_t (*vp)[D], int pairs) {
  constexpr int C = D / kLanes;
  __m512 a[R][C];
  for (int i = 0; i < R; ++i) {
    const vf al = set1(alpha[r0 + i]);
    for (int c = 0; c < C; ++c) a[i][c] = mul(loadu(acc[r0 + i] + kLanes * c), al);
  }
  for (int p = 0; p < pairs; ++p) {
    __m512i w[R];
    for (int i = 0; i < R; ++i) w[i] = bcast_pair(pp[p] + r0 + i);
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(vp[p] + kLanes * c));
      for (int i = 0; i < R; ++i) a[i][c] = dot2(a[i][c], v, w[i]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) storeu(acc[r0 + i] + kLanes * c, a[i][c]);
}

// One wide item of a bf16 cache: qrows[r] the row's bf16 query (unscaled); otherwise as
// wide_item (attention_simd.h).
template <int D, typename RowPtr, typename StoreRow>
void wide_item_bf16dot(const c10::BFloat16* const* qrows, float scale, const int64_t* positions,
                       int rows, const RowPtr& row, const StoreRow& store_row, int64_t window) {
  static_assert(D % kLanes == 0, "value pairs fill whole vectors");
  alignas(64) uint32_t qp[D / 2][kWideRows];
  alignas(64) float acc[kWideRows][D];
  alignas(64) float sT[kChunk][kWideRows];
  alignas(64) float alpha[kWideRows];
  alignas(64) uint32_t vp[kPairs][D];
  alignas(64) uint32_t pp[kPairs][kWideRows];
  const c10::BFloat16* keys[kChunk];
  const c10::BFloat16* vals[kChunk];
  WideState st;
  int64_t first, last;
  init_wide_state(st, positions, rows, window, first, last);
  for (int r = 0; r < kWideRows; ++r) {
    const uint16_t* q = reinterpret_cast<const uint16_t*>(qrows[r < rows ? r : 0]);
    for (int i = 0; i < D / 2; ++i)
      qp[i][r] = static_cast<uint32_t>(q[2 * i]) | (static_cast<uint32_t>(q[2 * i + 1]) << 16);
  }
  std::memset(acc, 0, sizeof(float) * D * rows);
  constexpr int R = 2 * (D / kLanes) + 2 <= kRegs ? 2 : 1;
  const int64_t band_end = window ? last - window + 1 : 0;
  for (int64_t p0 = first_key(first, window); p0 <= last; p0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - p0));
    for (int j = 0; j < n; ++j) {
      keys[j] = row(p0 + j, 0);
      vals[j] = row(p0 + j, 1);
    }
    dot_scores<D>(qp, keys, n, scale, sT);
    wide_softmax(st, sT, n, p0, p0 + n - 1 > first || p0 < band_end, alpha, window);
    value_pairs<D>(vals, n, vp);
    prob_pairs(sT, n, pp);
    const int pairs = (n + 1) / 2;
    int r = 0;
    for (; r + R <= rows; r += R) dot_pv_pass<D, R>(acc, r, alpha, pp, vp, pairs);
    for (; r < rows; ++r) dot_pv_pass<D, 1>(acc, r, alpha, pp, vp, pairs);
  }
  for (int r = 0; r < rows; ++r) store_row(r, acc[r], st.m[r], st.l[r]);
}

}  // namespace simd
}  // namespace deltaserve_cpu
#endif
