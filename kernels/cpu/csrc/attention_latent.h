// The vector body of a large-head work item (DeepSeek's MLA latent: keys of D = 576 dims, values
// their first DV = 512, one cached row per token shared by every query head), for AVX-512 and
// AVX2 + FMA alike through simd.h.
//
// A decode step of such a layer is a small GEMM per request (up to 48 of its query heads x D
// against its latent rows), so this item keeps its rows in the lanes of NV vectors (NV * kLanes
// rows, NV templated so that 16 heads fill one AVX-512 vector instead of three) and broadcasts
// the cached values, as attention_simd.h's wide tiles do:
//   scores   sT[j][rows] = sum_d K[j][d] qT[d][rows]
//   P V      accT[d][rows] = accT[d][rows] * alpha[rows] + sum_j V[j][d] P[j][rows]
// both K (keys or value dims) x NV accumulators at a time; the online softmax over sT is
// wide_softmax's. The query (qT), the accumulators (accT) and bf16 rows widened to float32 live
// in a per-thread scratch (over 100 KiB at 576 dims, too much for an OpenMP thread's stack).
// Values that are the keys' prefix in the same row (the cache seen twice, half == 0) are read
// from the keys' float32 rows, never widened twice. A bfloat16 cache on a CPU with AVX512-BF16
// takes the scores in bf16 pairs instead (latent_dot_scores_step: keys read in place, half the
// instructions; attention_bf16dot.h's pairing) and widens only the DV value dims.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "attention_simd.h"
#include "attention_bf16dot.h"

#if defined(DELTASERVE_SIMD)
namespace deltaserve_cpu {
namespace simd {

// Accumulator columns per step with NV lane vectors: the largest power of two <= kChunk whose
// K * NV accumulators, NV operands and one broadcast fit the vector registers.
constexpr int latent_step(int nv) {
  int k = kChunk;
  while (k > 1 && k * nv + nv + 1 > kRegs) k /= 2;
  return k;
}

// A per-thread float scratch of at least n floats, 64-byte aligned.
inline float* latent_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n + 16) buf.resize(n + 16);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// sT[j + a][..] = keys[j + a] . the rows in lanes (qT: [D][NV * kLanes]) for a < K.
template <int D, int NV, int K>
inline void latent_scores_step(const float* qT, const float* const* keys, int j,
                               float (*sT)[kWideRows]) {
  constexpr int W = NV * kLanes;
  vf acc[K][NV];
  for (int a = 0; a < K; ++a)
    for (int v = 0; v < NV; ++v) acc[a][v] = zero();
  for (int d = 0; d < D; ++d) {
    vf q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load(qT + d * W + kLanes * v);
    for (int a = 0; a < K; ++a) {
      const vf k = set1(keys[j + a][d]);
      for (int v = 0; v < NV; ++v) acc[a][v] = fmadd(k, q[v], acc[a][v]);
    }
  }
  for (int a = 0; a < K; ++a)
    for (int v = 0; v < NV; ++v) store(sT[j + a] + kLanes * v, acc[a][v]);
}

#if defined(DELTASERVE_BF16DOT)
// latent_scores_step for a bfloat16 cache with AVX512-BF16 dot products: qp [D / 2][W] holds
// each lane's query pair (unscaled bf16, as attention_bf16dot.h), the key's pair is broadcast;
// the products are exact in float32 and the scale applies to the sums.
template <int D, int NV, int K>
inline void latent_dot_scores_step(const uint32_t* qp, const c10::BFloat16* const* keys, int j,
                                   float scale, float (*sT)[kWideRows]) {
  constexpr int W = NV * kLanes;
  __m512 acc[K][NV];
  for (int a = 0; a < K; ++a)
    for (int v = 0; v < NV; ++v) acc[a][v] = zero();
  for (int i = 0; i < D / 2; ++i) {
    __m512i q[NV];
    for (int v = 0; v < NV; ++v)
      q[v] = _mm512_load_si512(reinterpret_cast<const void*>(qp + i * W + kLanes * v));
    for (int a = 0; a < K; ++a) {
      const __m512i k = bcast_pair(keys[j + a] + 2 * i);
      for (int v = 0; v < NV; ++v) acc[a][v] = dot2(acc[a][v], q[v], k);
    }
  }
  const vf s = set1(scale);
  for (int a = 0; a < K; ++a)
    for (int v = 0; v < NV; ++v) store(sT[j + a] + kLanes * v, mul(acc[a][v], s));
}
#endif

// accT[d][..] = accT[d][..] * alpha + sum_{j < n} vals[j][d] P[j][..] for d < DV, K dims a step.
template <int DV, int NV>
inline void latent_pv(float* accT, const float* alpha, const float (*sT)[kWideRows],
                      const float* const* vals, int n) {
  constexpr int W = NV * kLanes;
  constexpr int K = latent_step(NV);
  static_assert(DV % K == 0, "the value dims split into whole steps");
  vf al[NV];
  for (int v = 0; v < NV; ++v) al[v] = load(alpha + kLanes * v);
  for (int d0 = 0; d0 < DV; d0 += K) {
    vf acc[K][NV];
    for (int b = 0; b < K; ++b)
      for (int v = 0; v < NV; ++v) acc[b][v] = mul(load(accT + (d0 + b) * W + kLanes * v), al[v]);
    for (int j = 0; j < n; ++j) {
      vf p[NV];
      for (int v = 0; v < NV; ++v) p[v] = load(sT[j] + kLanes * v);
      for (int b = 0; b < K; ++b) {
        const vf w = set1(vals[j][d0 + b]);
        for (int v = 0; v < NV; ++v) acc[b][v] = fmadd(w, p[v], acc[b][v]);
      }
    }
    for (int b = 0; b < K; ++b)
      for (int v = 0; v < NV; ++v) store(accT + (d0 + b) * W + kLanes * v, acc[b][v]);
  }
}

// One large-head item of `rows` (<= NV * kLanes) query rows: qrows[r] the row's query
// (unscaled), positions[r] its position; row(p, which) the cache row of position p (0 keys, 1
// values); values_are_keys: row(p, 1) == row(p, 0). Hands each row's DV accumulated values,
// running max and sum to store_row(r, acc, m, l). No window and no sinks (the caller refuses).
template <typename T, int D, int DV, int NV, typename RowPtr, typename StoreRow>
void latent_item(const T* const* qrows, float scale, const int64_t* positions, int rows,
                 const RowPtr& row, bool values_are_keys, const StoreRow& store_row) {
  static_assert(D % kLanes == 0 && DV % kLanes == 0 && DV <= D, "whole vectors");
  constexpr int W = NV * kLanes;
  constexpr int K = latent_step(NV);
  float* qT = latent_scratch(static_cast<size_t>(D) * W + static_cast<size_t>(DV) * W +
                             static_cast<size_t>(kChunk) * (D + DV) + D);
  float* accT = qT + D * W;
  float* kbuf = accT + DV * W;
  float* vbuf = kbuf + kChunk * D;
  float* zeros = vbuf + kChunk * DV;      // the rows past a short chunk's last key
  alignas(64) float sT[kChunk][kWideRows];
  alignas(64) float alpha[kWideRows];
  const float* keys[kChunk];
  const float* vals[kChunk];
  WideState st;
  int64_t first, last;
  init_wide_state(st, positions, rows, 0, first, last);
#if defined(DELTASERVE_BF16DOT)
  constexpr bool kDot = std::is_same_v<T, c10::BFloat16>;   // scores in bf16 pairs
#else
  constexpr bool kDot = false;
#endif
  for (int r = 0; r < W; ++r) {
    const T* q = qrows[r < rows ? r : 0];
    if constexpr (kDot) {        // qT's room holds the pairs [D / 2][W]
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(q);
      uint32_t* qp = reinterpret_cast<uint32_t*>(qT);
      for (int i = 0; i < D / 2; ++i)
        qp[i * W + r] = bits[2 * i] | (static_cast<uint32_t>(bits[2 * i + 1]) << 16);
    } else {
      for (int d = 0; d < D; ++d) qT[d * W + r] = static_cast<float>(q[d]) * scale;
    }
  }
  std::memset(accT, 0, sizeof(float) * DV * W);
  std::memset(zeros, 0, sizeof(float) * D);
  for (int64_t p0 = 0; p0 <= last; p0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - p0));
#if defined(DELTASERVE_BF16DOT)
    if constexpr (kDot) {        // keys read in place; only the values widened
      const c10::BFloat16* kb[kChunk];
      for (int j = 0; j < kChunk; ++j) {
        kb[j] = j < n ? row(p0 + j, 0) : reinterpret_cast<const c10::BFloat16*>(zeros);
        if (j < n) vals[j] = as_f32<DV>(row(p0 + j, 1), vbuf + j * DV);
      }
      for (int j = 0; j < kChunk; j += K)
        latent_dot_scores_step<D, NV, K>(reinterpret_cast<const uint32_t*>(qT), kb, j, scale,
                                         sT);
    }
#endif
    if constexpr (!kDot) {
      for (int j = 0; j < kChunk; ++j) {
        if (j >= n) {
          keys[j] = zeros;
          continue;
        }
        keys[j] = as_f32<D>(row(p0 + j, 0), kbuf + j * D);
        vals[j] = values_are_keys ? keys[j] : as_f32<DV>(row(p0 + j, 1), vbuf + j * DV);
      }
      for (int j = 0; j < kChunk; j += K) latent_scores_step<D, NV, K>(qT, keys, j, sT);
    }
    wide_softmax<NV>(st, sT, n, p0, p0 + n - 1 > first, alpha, 0);
    latent_pv<DV, NV>(accT, alpha, sT, vals, n);
  }
  alignas(64) float out[DV];
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < DV; ++d) out[d] = accT[d * W + r];
    store_row(r, out, st.m[r], st.l[r]);
  }
}

// latent_item with NV = the lane vectors `rows` needs (1 .. kLaneVecs).
template <typename T, int D, int DV, typename RowPtr, typename StoreRow>
void latent_item_rows(const T* const* qrows, float scale, const int64_t* positions, int rows,
                      const RowPtr& row, bool values_are_keys, const StoreRow& store_row) {
  const int nv = (rows + kLanes - 1) / kLanes;
  switch (nv) {
    case 1: return latent_item<T, D, DV, 1>(qrows, scale, positions, rows, row, values_are_keys, store_row);
    case 2: return latent_item<T, D, DV, 2>(qrows, scale, positions, rows, row, values_are_keys, store_row);
    case 3: return latent_item<T, D, DV, 3>(qrows, scale, positions, rows, row, values_are_keys, store_row);
#if DELTASERVE_SIMD != 512
    case 4: return latent_item<T, D, DV, 4>(qrows, scale, positions, rows, row, values_are_keys, store_row);
    case 5: return latent_item<T, D, DV, 5>(qrows, scale, positions, rows, row, values_are_keys, store_row);
    case 6: return latent_item<T, D, DV, 6>(qrows, scale, positions, rows, row, values_are_keys, store_row);
#endif
    default: return;     // rows <= kWideRows (make_items)
  }
}

}  // namespace simd
}  // namespace deltaserve_cpu
#endif  // DELTASERVE_SIMD
