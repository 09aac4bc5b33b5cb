// Vector bodies of the paged attention work item (paged_attention.cpp draws the layout), for
// AVX-512 (16 lanes) and AVX2 + FMA (8 lanes) alike through simd.h.
//
// Two shapes of work item, both float32 inside:
//   * wide tiles (more than kDirectRows query rows: prefill): query rows live in the lanes of
//     kLaneVecs vectors (48 rows), keys are broadcast one value at a time:
//         sT[j][rows] = sum_d K[j][d] * qT[d][rows]          (qT transposed once per item)
//     so the running max, the exponentials and the row sums are plain lane-wise vector ops,
//     and P V accumulates one or two rows at a time against each value row.
//   * narrow items (decode: one token's G heads): each score is a dot product of a query row
//     and a key row (D / kLanes fused multiply-adds, one horizontal sum), and P V accumulates
//     each row against each value row.
// A sliding window W > 0 (window; 0: none) hides key k from the row at position p unless
// p - W < k: an item starts at the chunk of its first row's first key (first_key) and masks the
// chunks that hold keys below its last row's window.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include <c10/util/BFloat16.h>

#include "attention_fp8.h"
#include "simd.h"

#if defined(DELTASERVE_SIMD)   // a generic build has no vector bodies
namespace deltaserve_cpu {
namespace simd {

constexpr int kChunk = 16;                   // keys per online-softmax step
constexpr int kChunkVecs = kChunk / kLanes;  // vectors of one row's chunk scores: 1 or 2
constexpr int kWideRows = 48;
constexpr int kLaneVecs = kWideRows / kLanes;  // wide tiles: 3 (AVX-512) or 6 (AVX2) vectors
constexpr int kKeyStep = 12 / kLaneVecs;       // keys per wide score step: 12 accumulators
constexpr int kDirectRows = 8;                 // items with at most this many rows go direct

// The first key an item reads: 0, or with a window the start of the chunk holding the first
// key its earliest row (at position first_pos) sees; chunk starts stay multiples of kChunk.
inline int64_t first_key(int64_t first_pos, int64_t window) {
  return window ? std::max<int64_t>(0, first_pos - window + 1) / kChunk * kChunk : 0;
}

// Rows per pass of P V for head size D: two share each value load while their 2 D / kLanes
// accumulators (and the value and the two weights) fit in the registers.
template <int D>
constexpr int kPvRows = 2 * (D / kLanes) + 3 <= kRegs ? 2 : 1;

// A row of D values as float32: the row itself for float caches, else converted into buf.
template <int D>
inline const float* as_f32(const float* src, float* /*buf*/) { return src; }
template <int D>
inline const float* as_f32(const c10::BFloat16* src, float* buf) {
  for (int c = 0; c < D / kLanes; ++c) storeu(buf + kLanes * c, loadu(src + kLanes * c));
  return buf;
}
// (fp8 caches: attention_fp8.h's overloads)

// Key/value rows of positions p0 .. p0+n-1 as float32 pointers.
template <typename T, int D, typename RowPtr>
inline void chunk_rows(const RowPtr& row, int64_t p0, int n, int which,
                       float (*buf)[D], const float** rows) {
  for (int j = 0; j < n; ++j) rows[j] = as_f32<D>(row(p0 + j, which), buf[j]);
}

// acc[r] = acc[r] * alpha[r] (alpha may be null: no rescale) + sum_j p(r, j) V[j] for R rows
// from r0, sharing each value vector's load between the R rows.
template <int D, int R, typename P>
inline void pv_pass(float (*acc)[D], int r0, const float* alpha, const P& p,
                    const float* const* vals, int n) {
  constexpr int C = D / kLanes;
  vf a[R][C];
  for (int i = 0; i < R; ++i) {
    const vf al = alpha ? set1(alpha[r0 + i]) : set1(1.0f);
    for (int c = 0; c < C; ++c)
      a[i][c] = alpha ? mul(loadu(acc[r0 + i] + kLanes * c), al) : loadu(acc[r0 + i] + kLanes * c);
  }
  for (int j = 0; j < n; ++j) {
    vf w[R];
    for (int i = 0; i < R; ++i) w[i] = set1(p(r0 + i, j));
    for (int c = 0; c < C; ++c) {
      const vf v = loadu(vals[j] + kLanes * c);
      for (int i = 0; i < R; ++i) a[i][c] = fmadd(w[i], v, a[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) storeu(acc[r0 + i] + kLanes * c, a[i][c]);
}

template <int D, typename P>
inline void accumulate_pv(float (*acc)[D], const float* alpha, const P& p,
                          const float* const* vals, int n, int rows) {
  constexpr int R = kPvRows<D>;
  int r = 0;
  for (; r + R <= rows; r += R) pv_pass<D, R>(acc, r, alpha, p, vals, n);
  for (; r < rows; ++r) pv_pass<D, 1>(acc, r, alpha, p, vals, n);
}

// ---- wide tiles: rows in lanes ------------------------------------------------------------

struct WideState {
  alignas(64) float m[kWideRows];
  alignas(64) float l[kWideRows];
  alignas(64) float pos[kWideRows];        // each row's position (float; < 2^24)
};

// The state of a wide item's kWideRows lanes (padding lanes copy row 0; their results are
// dropped); first / last: the smallest and largest position of its rows.
inline void init_wide_state(WideState& st, const int64_t* positions, int rows, int64_t window,
                            int64_t& first, int64_t& last) {
  // With a window a row may see none of a chunk's keys; a finite starting max keeps its
  // rescale factor e^(m - max) a number (e^(-inf - -inf) is not).
  const float m0 = window ? std::numeric_limits<float>::lowest()
                          : -std::numeric_limits<float>::infinity();
  first = positions[0];
  last = positions[0];
  for (int r = 0; r < kWideRows; ++r) {
    const int64_t p = positions[r < rows ? r : 0];
    st.pos[r] = static_cast<float>(p);
    st.m[r] = m0;
    st.l[r] = 0.f;
    last = std::max(last, p);
    first = std::min(first, p);
  }
}

// sT[j][..] for keys j .. j + K - 1
template <int D, int K>
inline void wide_scores_step(const float (*qT)[kWideRows], const float* const* keys, int j,
                             float (*sT)[kWideRows]) {
  vf acc[K][kLaneVecs];
  for (int a = 0; a < K; ++a)
    for (int v = 0; v < kLaneVecs; ++v) acc[a][v] = zero();
  for (int d = 0; d < D; ++d) {
    vf q[kLaneVecs];
    for (int v = 0; v < kLaneVecs; ++v) q[v] = load(qT[d] + kLanes * v);
    for (int a = 0; a < K; ++a) {
      const vf k = set1(keys[j + a][d]);
      for (int v = 0; v < kLaneVecs; ++v) acc[a][v] = fmadd(k, q[v], acc[a][v]);
    }
  }
  for (int a = 0; a < K; ++a)
    for (int v = 0; v < kLaneVecs; ++v) store(sT[j + a] + kLanes * v, acc[a][v]);
}

template <int D>
inline void wide_scores(const float (*qT)[kWideRows], const float* const* keys, int n,
                        float (*sT)[kWideRows]) {
  int j = 0;
  for (; j + kKeyStep <= n; j += kKeyStep) wide_scores_step<D, kKeyStep>(qT, keys, j, sT);
  for (; j < n; ++j) wide_scores_step<D, 1>(qT, keys, j, sT);
}

// Online softmax step over n keys starting at position p0 (masked when `masked`, also below
// each row's window when window > 0): turns sT into probabilities, updates m and l, and leaves
// each row's rescale factor in alpha; Vecs: the lane vectors in use, a constant (rows beyond
// are left alone; attention_latent.h's items fill fewer than kLaneVecs). Not inlined: inside
// the item's loop it left bfloat16 prefill 20% slower on AVX-512 (spills).
template <int Vecs = kLaneVecs>
__attribute__((noinline)) void wide_softmax(WideState& st, float (*sT)[kWideRows], int n,
                                            int64_t p0, bool masked, float* alpha,
                                            int64_t window) {
  const vf neg_inf = set1(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < Vecs; ++v) {
    const vf pos = load(st.pos + kLanes * v);
    vf mx = load(st.m + kLanes * v);
    for (int j = 0; j < n; ++j) {
      vf s = load(sT[j] + kLanes * v);
      if (masked) {
        s = select(lt(pos, set1(static_cast<float>(p0 + j))), s, neg_inf);
        if (window)     // rows at pos >= key + window no longer see the key
          s = select(ge(pos, set1(static_cast<float>(p0 + j + window))), s, neg_inf);
        store(sT[j] + kLanes * v, s);
      }
      mx = max(mx, s);
    }
    const vf a = exp(sub(load(st.m + kLanes * v), mx));
    vf sum = mul(load(st.l + kLanes * v), a);
    for (int j = 0; j < n; ++j) {
      const vf p = exp(sub(load(sT[j] + kLanes * v), mx));
      store(sT[j] + kLanes * v, p);
      sum = add(sum, p);
    }
    store(st.m + kLanes * v, mx);
    store(st.l + kLanes * v, sum);
    store(alpha + kLanes * v, a);
  }
}

// One wide item: q rows [rows][D] (scaled), row positions; row(p, which) gives the cache row
// of position p (which: 0 keys, 1 values). Hands each row's acc, running max m and sum l to
// store_row(r, acc, m, l), which normalises it (and folds in an attention sink).
template <typename T, int D, typename RowPtr, typename StoreRow>
void wide_item(const float (*q)[D], const int64_t* positions, int rows, const RowPtr& row,
               const StoreRow& store_row, int64_t window) {
  alignas(64) float qT[D][kWideRows];
  alignas(64) float acc[kWideRows][D];
  alignas(64) float sT[kChunk][kWideRows];
  alignas(64) float alpha[kWideRows];
  alignas(64) float kbuf[kChunk][D];
  alignas(64) float vbuf[kChunk][D];
  const float* keys[kChunk];
  const float* vals[kChunk];
  WideState st;
  int64_t first, last;
  init_wide_state(st, positions, rows, window, first, last);
  for (int r = 0; r < kWideRows; ++r)
    for (int d = 0; d < D; ++d) qT[d][r] = q[r < rows ? r : 0][d];
  std::memset(acc, 0, sizeof(float) * D * rows);
  const auto p_at = [&](int r, int j) { return sT[j][r]; };
  const int64_t band_end = window ? last - window + 1 : 0;   // keys below: masked for some row
  for (int64_t p0 = first_key(first, window); p0 <= last; p0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - p0));
    chunk_rows<T, D>(row, p0, n, 0, kbuf, keys);
    chunk_rows<T, D>(row, p0, n, 1, vbuf, vals);
    wide_scores<D>(qT, keys, n, sT);
    wide_softmax(st, sT, n, p0, p0 + n - 1 > first || p0 < band_end, alpha, window);
    accumulate_pv<D>(acc, alpha, p_at, vals, n, rows);
  }
  for (int r = 0; r < rows; ++r) store_row(r, acc[r], st.m[r], st.l[r]);
}

// ---- narrow items: one dot product per (row, key) -----------------------------------------

#if DELTASERVE_SIMD == 512
// out lane j = the sum of the 16 lanes of v[j]: a transpose-and-add tree (about 3 shuffles
// and adds per vector instead of a full horizontal reduction each).
inline __m512 sum_lanes(const __m512* v) {
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
#else
// out lane j = the sum of the 8 lanes of v[j] (horizontal adds, then the two 128-bit halves).
inline __m256 sum_lanes(const __m256* v) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                       _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

// Cache lines of one cached row of D values of T.
template <typename T, int D>
constexpr int kRowLines = (D * static_cast<int>(sizeof(T)) + 63) / 64;

// Key and value rows to prefetch (a decode item reads each row once, from blocks scattered
// over the cache: out of L2 it waited on memory, ~35 ns per key against ~14 ns in L2).
struct Ahead {
  const char* keys = nullptr;     // the first key row; rows row_bytes apart
  const char* values = nullptr;
  int64_t row_bytes = 0;
  int n = 0;                      // rows
};

// s[j] = q . keys[j] for j < n, 0 past n (s: kChunk floats, aligned); kLanes keys at a time.
// With kLines > 0 the rows of `ahead` (the next chunk's) are prefetched into L2, one key and
// value row per key computed, so that the requests overlap this chunk's arithmetic.
template <int D, int kLines = 0>
inline void chunk_dots(const float* q, const float* const* keys, int n, float* s,
                       const Ahead& ahead = Ahead()) {
  constexpr int C = D / kLanes;
  vf qv[C];
  for (int c = 0; c < C; ++c) qv[c] = loadu(q + kLanes * c);
  for (int h = 0; h < kChunkVecs; ++h) {
    vf part[kLanes];
    for (int i = 0; i < kLanes; ++i) {
      const int j = kLanes * h + i;
      if (kLines > 0 && j < ahead.n) {
        for (int l = 0; l < kLines; ++l) {
          __builtin_prefetch(ahead.keys + j * ahead.row_bytes + 64 * l, 0, 2);
          __builtin_prefetch(ahead.values + j * ahead.row_bytes + 64 * l, 0, 2);
        }
      }
      if (j >= n) {
        part[i] = zero();
        continue;
      }
      vf acc = mul(qv[0], loadu(keys[j]));
      for (int c = 1; c < C; ++c) acc = fmadd(qv[c], loadu(keys[j] + kLanes * c), acc);
      part[i] = acc;
    }
    store(s + kLanes * h, sum_lanes(part));
  }
}

// Row r's chunk: scores s (visible lanes: the first `visible`, less the first `below`) become
// e^(s - m) in place; the running max m, the lane-wise sums lsum and the row's acc (D values)
// are rescaled on a new max.
template <int D>
inline void narrow_softmax_row(float* s, int64_t visible, int64_t below, float& m, float* lsum,
                               float* acc) {
  const vf neg_inf = set1(-std::numeric_limits<float>::infinity());
  vf sv[kChunkVecs];
  vf mx = neg_inf;
  for (int h = 0; h < kChunkVecs; ++h) {
    sv[h] = select(first(visible - kLanes * h), neg_inf, load(s + kLanes * h));
    if (below > 0) sv[h] = select(first(below - kLanes * h), sv[h], neg_inf);   // window
    mx = max(mx, sv[h]);
  }
  const float cmax = reduce_max(mx);
  if (cmax > m) {                 // a new max: rescale what was summed so far
    const vf av = set1(first_lane(exp(set1(m - cmax))));   // 0 at first
    for (int h = 0; h < kChunkVecs; ++h) store(lsum + kLanes * h, mul(load(lsum + kLanes * h), av));
    for (int c = 0; c < D / kLanes; ++c) store(acc + kLanes * c, mul(load(acc + kLanes * c), av));
    m = cmax;
  }
  for (int h = 0; h < kChunkVecs; ++h) {
    if (m == -std::numeric_limits<float>::infinity()) {
      store(s + kLanes * h, zero());
      continue;
    }
    const vf p = exp(sub(sv[h], set1(m)));
    store(lsum + kLanes * h, add(load(lsum + kLanes * h), p));
    store(s + kLanes * h, p);
  }
}

template <typename T, int D, typename RowPtr, typename StoreRow>
void narrow_item(const float (*q)[D], const int64_t* positions, int rows, const RowPtr& row,
                 int64_t block_size, int64_t row_stride, const StoreRow& store_row,
                 int64_t window, const Ahead& after = Ahead()) {
  alignas(64) float acc[kDirectRows][D];
  alignas(64) float s[kDirectRows][kChunk];
  alignas(64) float lsum[kDirectRows][kChunk];  // the running sums, lane-wise (reduced at the end)
  alignas(64) float kbuf[kChunk][D];
  alignas(64) float vbuf[kChunk][D];
  const float* keys[kChunk];
  const float* vals[kChunk];
  float m[kDirectRows];
  int64_t last = 0, first_pos = positions[0];
  for (int r = 0; r < rows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    last = std::max(last, positions[r]);
    first_pos = std::min(first_pos, positions[r]);
  }
  std::memset(lsum, 0, sizeof lsum);
  std::memset(acc, 0, sizeof acc);
  const bool chunk_in_block = block_size % kChunk == 0;     // chunks start at multiples of 16
  const auto p_at = [&](int r, int j) { return s[r][j]; };
  for (int64_t p0 = first_key(first_pos, window); p0 <= last; p0 += kChunk) {
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
    // what to prefetch: after the last chunk the next item's first; else the next chunk when
    // it lies in one block (scattered rows are not worth it)
    Ahead ahead;
    if (p0 + kChunk > last) {
      ahead = after;
    } else if (chunk_in_block) {
      ahead.keys = reinterpret_cast<const char*>(row(p0 + kChunk, 0));
      ahead.values = reinterpret_cast<const char*>(row(p0 + kChunk, 1));
      ahead.row_bytes = row_stride * static_cast<int64_t>(sizeof(T));
      ahead.n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - p0 - kChunk));
    }
    chunk_dots<D, kRowLines<T, D>>(q[0], keys, n, s[0], ahead);
    for (int r = 1; r < rows; ++r) chunk_dots<D>(q[r], keys, n, s[r]);
    for (int r = 0; r < rows; ++r)   // lanes below <= j < visible are keys this row may see
      narrow_softmax_row<D>(s[r], std::min<int64_t>(positions[r] - p0 + 1, n),
                            window ? positions[r] - window + 1 - p0 : 0, m[r], lsum[r], acc[r]);
    accumulate_pv<D>(acc, nullptr, p_at, vals, n, rows);
  }
  for (int r = 0; r < rows; ++r) {
    vf total = zero();
    for (int h = 0; h < kChunkVecs; ++h) total = add(total, load(lsum[r] + kLanes * h));
    store_row(r, acc[r], m[r], reduce_add(total));
  }
}

}  // namespace simd
}  // namespace deltaserve_cpu
#endif  // DELTASERVE_SIMD
