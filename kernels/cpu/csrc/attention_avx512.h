// AVX-512 bodies of the paged attention work item (paged_attention.cpp draws the layout).
//
// Two shapes of work item, both float32 inside:
//   * wide tiles (more than kDirectRows query rows: prefill): query rows live in the 16 lanes of
//     kLaneVecs vectors, keys are broadcast one value at a time:
//         sT[j][rows] = sum_d K[j][d] * qT[d][rows]          (qT transposed once per item)
//     so the running max, the exponentials and the row sums are plain lane-wise vector ops,
//     and P V accumulates two rows at a time against each value row.
//   * narrow items (decode: one token's G heads): each score is a dot product of a query row
//     and a key row (D / 16 fused multiply-adds, one horizontal sum), and P V accumulates
//     each row against each value row.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include <c10/util/BFloat16.h>

#include "exp512.h"

namespace deltaserve_cpu {
namespace avx512 {

constexpr int kChunk = 16;                 // keys per online-softmax step
constexpr int kLaneVecs = 3;               // wide tiles: up to 48 rows
constexpr int kWideRows = 16 * kLaneVecs;
constexpr int kDirectRows = 8;             // items with at most this many rows go direct

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// A row of D values as float32: the row itself for float caches, else converted into buf.
template <int D>
inline const float* as_f32(const float* src, float* /*buf*/) { return src; }
template <int D>
inline const float* as_f32(const c10::BFloat16* src, float* buf) {
  for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(buf + 16 * c, load16(src + 16 * c));
  return buf;
}

// Key/value rows of positions p0 .. p0+n-1 as float32 pointers.
template <typename T, int D, typename RowPtr>
inline void chunk_rows(const RowPtr& row, int64_t p0, int n, int which,
                       float (*buf)[D], const float** rows) {
  for (int j = 0; j < n; ++j) rows[j] = as_f32<D>(row(p0 + j, which), buf[j]);
}

// ---- wide tiles: rows in lanes ------------------------------------------------------------

struct WideState {
  alignas(64) float m[kWideRows];
  alignas(64) float l[kWideRows];
  alignas(64) float pos[kWideRows];        // each row's position (float; < 2^24)
};

template <int D>
inline void wide_scores(const float (*qT)[kWideRows], const float* const* keys, int n,
                        float (*sT)[kWideRows]) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 acc[4][kLaneVecs];
    for (int a = 0; a < 4; ++a)
      for (int v = 0; v < kLaneVecs; ++v) acc[a][v] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 q0 = _mm512_load_ps(qT[d]), q1 = _mm512_load_ps(qT[d] + 16),
                   q2 = _mm512_load_ps(qT[d] + 32);
      for (int a = 0; a < 4; ++a) {
        const __m512 k = _mm512_set1_ps(keys[j + a][d]);
        acc[a][0] = _mm512_fmadd_ps(k, q0, acc[a][0]);
        acc[a][1] = _mm512_fmadd_ps(k, q1, acc[a][1]);
        acc[a][2] = _mm512_fmadd_ps(k, q2, acc[a][2]);
      }
    }
    for (int a = 0; a < 4; ++a)
      for (int v = 0; v < kLaneVecs; ++v) _mm512_store_ps(sT[j + a] + 16 * v, acc[a][v]);
  }
  for (; j < n; ++j) {
    __m512 acc[kLaneVecs] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int d = 0; d < D; ++d) {
      const __m512 k = _mm512_set1_ps(keys[j][d]);
      for (int v = 0; v < kLaneVecs; ++v)
        acc[v] = _mm512_fmadd_ps(k, _mm512_load_ps(qT[d] + 16 * v), acc[v]);
    }
    for (int v = 0; v < kLaneVecs; ++v) _mm512_store_ps(sT[j] + 16 * v, acc[v]);
  }
}

// Online softmax step over n keys starting at position p0 (masked when `masked`): turns sT
// into probabilities, updates m and l, and leaves each row's rescale factor in alpha.
inline void wide_softmax(WideState& st, float (*sT)[kWideRows], int n, int64_t p0, bool masked,
                         float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < kLaneVecs; ++v) {
    const __m512 pos = _mm512_load_ps(st.pos + 16 * v);
    __m512 mx = _mm512_load_ps(st.m + 16 * v);
    for (int j = 0; j < n; ++j) {
      __m512 s = _mm512_load_ps(sT[j] + 16 * v);
      if (masked) {
        const __mmask16 hidden = _mm512_cmp_ps_mask(
            pos, _mm512_set1_ps(static_cast<float>(p0 + j)), _CMP_LT_OQ);
        s = _mm512_mask_mov_ps(s, hidden, neg_inf);
        _mm512_store_ps(sT[j] + 16 * v, s);
      }
      mx = _mm512_max_ps(mx, s);
    }
    const __m512 a = exp512(_mm512_sub_ps(_mm512_load_ps(st.m + 16 * v), mx));
    __m512 sum = _mm512_mul_ps(_mm512_load_ps(st.l + 16 * v), a);
    for (int j = 0; j < n; ++j) {
      const __m512 p = exp512(_mm512_sub_ps(_mm512_load_ps(sT[j] + 16 * v), mx));
      _mm512_store_ps(sT[j] + 16 * v, p);
      sum = _mm512_add_ps(sum, p);
    }
    _mm512_store_ps(st.m + 16 * v, mx);
    _mm512_store_ps(st.l + 16 * v, sum);
    _mm512_store_ps(alpha + 16 * v, a);
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j P[j][r] V[j], two rows at a time.
template <int D>
inline void wide_values(float (*acc)[D], const float* alpha, const float (*pT)[kWideRows],
                        const float* const* vals, int n, int rows) {
  constexpr int C = D / 16;
  int r = 0;
  for (; r + 2 <= rows; r += 2) {
    __m512 a0[C], a1[C];
    const __m512 al0 = _mm512_set1_ps(alpha[r]), al1 = _mm512_set1_ps(alpha[r + 1]);
    for (int c = 0; c < C; ++c) {
      a0[c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * c), al0);
      a1[c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r + 1] + 16 * c), al1);
    }
    for (int j = 0; j < n; ++j) {
      const __m512 p0 = _mm512_set1_ps(pT[j][r]), p1 = _mm512_set1_ps(pT[j][r + 1]);
      for (int c = 0; c < C; ++c) {
        const __m512 v = _mm512_loadu_ps(vals[j] + 16 * c);
        a0[c] = _mm512_fmadd_ps(p0, v, a0[c]);
        a1[c] = _mm512_fmadd_ps(p1, v, a1[c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(acc[r] + 16 * c, a0[c]);
      _mm512_storeu_ps(acc[r + 1] + 16 * c, a1[c]);
    }
  }
  for (; r < rows; ++r) {
    __m512 a0[C];
    const __m512 al0 = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < C; ++c) a0[c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * c), al0);
    for (int j = 0; j < n; ++j) {
      const __m512 p0 = _mm512_set1_ps(pT[j][r]);
      for (int c = 0; c < C; ++c)
        a0[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vals[j] + 16 * c), a0[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[r] + 16 * c, a0[c]);
  }
}

// One wide item: q rows [rows][D] (scaled), row positions; row(p, which) gives the cache row
// of position p (which: 0 keys, 1 values). Writes acc / l into out rows via store_row(r, data).
template <typename T, int D, typename RowPtr, typename StoreRow>
void wide_item(const float (*q)[D], const int64_t* positions, int rows, const RowPtr& row,
               const StoreRow& store_row) {
  alignas(64) float qT[D][kWideRows];
  alignas(64) float acc[kWideRows][D];
  alignas(64) float sT[kChunk][kWideRows];
  alignas(64) float alpha[kWideRows];
  alignas(64) float kbuf[kChunk][D];
  alignas(64) float vbuf[kChunk][D];
  const float* keys[kChunk];
  const float* vals[kChunk];
  WideState st;
  int64_t last = 0, first = positions[0];
  for (int r = 0; r < kWideRows; ++r) {
    const int src = r < rows ? r : 0;                  // padding lanes copy row 0 (dropped)
    for (int d = 0; d < D; ++d) qT[d][r] = q[src][d];
    st.pos[r] = static_cast<float>(positions[src]);
    st.m[r] = -std::numeric_limits<float>::infinity();
    st.l[r] = 0.f;
    last = std::max(last, positions[src]);
    first = std::min(first, positions[src]);
  }
  std::memset(acc, 0, sizeof(float) * D * rows);
  for (int64_t p0 = 0; p0 <= last; p0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - p0));
    chunk_rows<T, D>(row, p0, n, 0, kbuf, keys);
    chunk_rows<T, D>(row, p0, n, 1, vbuf, vals);
    wide_scores<D>(qT, keys, n, sT);
    wide_softmax(st, sT, n, p0, p0 + n - 1 > first, alpha);
    wide_values<D>(acc, alpha, sT, vals, n, rows);
  }
  for (int r = 0; r < rows; ++r) store_row(r, acc[r], 1.0f / st.l[r]);
}

// ---- narrow items: one dot product per (row, key) -----------------------------------------

// out lane j = the sum of the 16 lanes of v[j]: a transpose-and-add tree (about 3 shuffles
// and adds per vector instead of a full horizontal reduction each).
inline __m512 sum16x16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i], 128-bit lane L, element e: partial sum (lane L's four values) of key 4i + e.
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44),
                                   _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44),
                                   _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88),
                       _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// s[j] = q . keys[j] for j < n (lanes past n: 0).
template <int D>
inline __m512 chunk_dots(const float* q, const float* const* keys, int n) {
  constexpr int C = D / 16;
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 part[kChunk];
  for (int j = 0; j < kChunk; ++j) {
    if (j >= n) {
      part[j] = _mm512_setzero_ps();
      continue;
    }
    __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys[j]));
    for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(keys[j] + 16 * c), s);
    part[j] = s;
  }
  return sum16x16(part);
}

template <typename T, int D, typename RowPtr, typename StoreRow>
void narrow_item(const float (*q)[D], const int64_t* positions, int rows, const RowPtr& row,
                 int64_t block_size, int64_t row_stride, const StoreRow& store_row) {
  constexpr int C = D / 16;
  alignas(64) float acc[kDirectRows][D];
  alignas(64) float s[kDirectRows][kChunk];
  alignas(64) float lsum[kDirectRows][16];     // the running sums, lane-wise (reduced at the end)
  alignas(64) float kbuf[kChunk][D];
  alignas(64) float vbuf[kChunk][D];
  const float* keys[kChunk];
  const float* vals[kChunk];
  float m[kDirectRows];
  int64_t last = 0;
  for (int r = 0; r < rows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    _mm512_store_ps(lsum[r], _mm512_setzero_ps());
    last = std::max(last, positions[r]);
  }
  std::memset(acc, 0, sizeof acc);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const bool chunk_in_block = block_size % kChunk == 0;     // chunks start at multiples of 16
  for (int64_t p0 = 0; p0 <= last; p0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - p0));
    if (chunk_in_block) {
      const T* kb = row(p0, 0);
      const T* vb = row(p0, 1);
      for (int j = 0; j < n; ++j) {
        keys[j] = as_f32<D>(kb + j * row_stride, kbuf[j]);
        vals[j] = as_f32<D>(vb + j * row_stride, vbuf[j]);
      }
    } else {
      chunk_rows<T, D>(row, p0, n, 0, kbuf, keys);
      chunk_rows<T, D>(row, p0, n, 1, vbuf, vals);
    }
    for (int r = 0; r < rows; ++r) _mm512_store_ps(s[r], chunk_dots<D>(q[r], keys, n));
    for (int r = 0; r < rows; ++r) {
      // lanes j < visible are real keys this row may see
      const int64_t visible = std::min<int64_t>(positions[r] - p0 + 1, n);
      const __mmask16 keep = _mm512_cmp_epi32_mask(
          lane, _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(visible, 0))), _MM_CMPINT_LT);
      const __m512 sv = _mm512_mask_mov_ps(neg_inf, keep, _mm512_load_ps(s[r]));
      const float cmax = _mm512_reduce_max_ps(sv);
      if (cmax > m[r]) {                 // a new max: rescale what was summed so far
        const float a = _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[r] - cmax)));   // 0 at first
        const __m512 av = _mm512_set1_ps(a);
        _mm512_store_ps(lsum[r], _mm512_mul_ps(_mm512_load_ps(lsum[r]), av));
        for (int c = 0; c < C; ++c)
          _mm512_store_ps(acc[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), av));
        m[r] = cmax;
      }
      if (m[r] == -std::numeric_limits<float>::infinity()) {
        _mm512_store_ps(s[r], _mm512_setzero_ps());
        continue;
      }
      const __m512 p = exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m[r])));
      _mm512_store_ps(lsum[r], _mm512_add_ps(_mm512_load_ps(lsum[r]), p));
      _mm512_store_ps(s[r], p);
    }
    // P V, two rows per pass over the values (each value vector loaded once for both).
    int r = 0;
    for (; r + 2 <= rows; r += 2) {
      __m512 a0[C], a1[C];
      for (int c = 0; c < C; ++c) {
        a0[c] = _mm512_load_ps(acc[r] + 16 * c);
        a1[c] = _mm512_load_ps(acc[r + 1] + 16 * c);
      }
      for (int j = 0; j < n; ++j) {
        const __m512 p0 = _mm512_set1_ps(s[r][j]), p1 = _mm512_set1_ps(s[r + 1][j]);
        for (int c = 0; c < C; ++c) {
          const __m512 v = _mm512_loadu_ps(vals[j] + 16 * c);
          a0[c] = _mm512_fmadd_ps(p0, v, a0[c]);
          a1[c] = _mm512_fmadd_ps(p1, v, a1[c]);
        }
      }
      for (int c = 0; c < C; ++c) {
        _mm512_store_ps(acc[r] + 16 * c, a0[c]);
        _mm512_store_ps(acc[r + 1] + 16 * c, a1[c]);
      }
    }
    for (; r < rows; ++r) {
      __m512 a0[C];
      for (int c = 0; c < C; ++c) a0[c] = _mm512_load_ps(acc[r] + 16 * c);
      for (int j = 0; j < n; ++j) {
        const __m512 pj = _mm512_set1_ps(s[r][j]);
        for (int c = 0; c < C; ++c)
          a0[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vals[j] + 16 * c), a0[c]);
      }
      for (int c = 0; c < C; ++c) _mm512_store_ps(acc[r] + 16 * c, a0[c]);
    }
  }
  for (int r = 0; r < rows; ++r)
    store_row(r, acc[r], 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(lsum[r])));
}

}  // namespace avx512
}  // namespace deltaserve_cpu
