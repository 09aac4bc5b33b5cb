// The portable body of one paged attention work item (attention_item.h): the loops a generic
// build runs, and any head dim the vector bodies do not take (paged_attention.cpp dispatches).
// Flash-attention style over chunks of kChunk key positions: scores for the whole chunk, an
// online softmax (running max m and sum l per row) and the value accumulation, all in float32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_item.h"
#include "vec_math.h"

namespace deltaserve_cpu {
namespace paged {

// A per-thread float scratch of at least n floats, 64-byte aligned (the generic body's buffers:
// over 200 KiB at the latent's 576 dims, too much for an OpenMP thread's stack).
inline float* thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n + 16) buf.resize(n + 16);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// kt[d][j] = key of position p0 + j (j < n), float32; columns n..kChunk-1 are zero.
template <typename T, int D>
inline void load_keys_t(const Geometry<T>& g, int64_t head, int64_t p0, int n,
                        float (*kt)[kChunk]) {
  for (int j = 0; j < kChunk; ++j) {
    if (j >= n) {
      for (int d = 0; d < D; ++d) kt[d][j] = 0.f;
      continue;
    }
    const int64_t p = p0 + j;
    const T* k = g.kv + g.blocks[p / g.block_size] * g.block_stride +
                 (p % g.block_size) * g.row_stride + head * g.head_stride;
    for (int d = 0; d < D; ++d) kt[d][j] = to_float(k[d]);
  }
}

// v[j][:] = the first D dims of the value of position p0 + j (j < n), float32.
template <typename T, int D>
inline void load_values(const Geometry<T>& g, int64_t head, int64_t p0, int n,
                        float (*v)[D]) {
  for (int j = 0; j < n; ++j) {
    const int64_t p = p0 + j;
    const T* src = g.kv + g.half + g.blocks[p / g.block_size] * g.block_stride +
                   (p % g.block_size) * g.row_stride + head * g.head_stride;
    for (int d = 0; d < D; ++d) v[j][d] = to_float(src[d]);
  }
}

// s[r][j] = sum_d q[r][d] * kt[d][j] for rows 0..rows-1 (q already scaled).
template <int D>
inline void chunk_scores(const float (*q)[D], const float (*kt)[kChunk], int rows,
                         float (*s)[kChunk]) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    float a0[kChunk] = {}, a1[kChunk] = {}, a2[kChunk] = {}, a3[kChunk] = {};
    for (int d = 0; d < D; ++d) {
      const float q0 = q[r][d], q1 = q[r + 1][d], q2 = q[r + 2][d], q3 = q[r + 3][d];
#pragma omp simd
      for (int j = 0; j < kChunk; ++j) {
        a0[j] += q0 * kt[d][j];
        a1[j] += q1 * kt[d][j];
        a2[j] += q2 * kt[d][j];
        a3[j] += q3 * kt[d][j];
      }
    }
    std::memcpy(s[r], a0, sizeof a0);
    std::memcpy(s[r + 1], a1, sizeof a1);
    std::memcpy(s[r + 2], a2, sizeof a2);
    std::memcpy(s[r + 3], a3, sizeof a3);
  }
  for (; r < rows; ++r) {
    float a0[kChunk] = {};
    for (int d = 0; d < D; ++d) {
      const float q0 = q[r][d];
#pragma omp simd
      for (int j = 0; j < kChunk; ++j) a0[j] += q0 * kt[d][j];
    }
    std::memcpy(s[r], a0, sizeof a0);
  }
}

// T: the query's and out's type; KT: the cache's (T, or an fp8 type: attention_fp8.h).
template <typename T, typename KT, int D, int DV>
void attend_item(const Item& it, const Geometry<KT>& g, const T* query, int64_t q_tok_stride,
                 int64_t q_head_stride, T* out, int64_t o_tok_stride, int64_t o_head_stride,
                 int64_t q_start, int64_t first_pos, int group, float scale, int64_t window,
                 const float* sinks) {
  const int ng = it.ng;
  const int rows = static_cast<int>(it.ntok) * ng;
  float* buf = thread_scratch(kTileRows * (D + DV + kChunk) + kChunk * (D + DV));
  auto q = reinterpret_cast<float (*)[D]>(buf);
  auto acc = reinterpret_cast<float (*)[DV]>(buf + kTileRows * D);
  auto kt = reinterpret_cast<float (*)[kChunk]>(buf + kTileRows * (D + DV));
  auto v = reinterpret_cast<float (*)[DV]>(buf + kTileRows * (D + DV) + D * kChunk);
  auto s = reinterpret_cast<float (*)[kChunk]>(buf + kTileRows * (D + DV) + kChunk * (D + DV));
  float m[kTileRows], l[kTileRows];
  int64_t pos[kTileRows];
  for (int t = 0; t < it.ntok; ++t) {
    for (int gi = 0; gi < ng; ++gi) {
      const int r = t * ng + gi;
      const T* src = query + (q_start + it.tok0 + t) * q_tok_stride +
                     (it.head * group + it.g0 + gi) * q_head_stride;
      for (int d = 0; d < D; ++d) q[r][d] = to_float(src[d]) * scale;
      pos[r] = first_pos + it.tok0 + t;
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.f;
      std::memset(acc[r], 0, sizeof(float) * DV);
    }
  }
  const int64_t last = first_pos + it.tok0 + it.ntok - 1;      // the tile's last position
  const int64_t diag = first_pos + it.tok0;                    // from here, keys may be masked
  // window: chunks from the first row's first key; below band_end the last row's are masked
  const int64_t start = window ? std::max<int64_t>(0, diag - window + 1) / kChunk * kChunk : 0;
  const int64_t band_end = window ? last - window + 1 : 0;
  for (int64_t p0 = start; p0 <= last; p0 += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - p0));
    load_keys_t<KT, D>(g, it.head, p0, n, kt);
    load_values<KT, DV>(g, it.head, p0, n, v);
    chunk_scores<D>(q, kt, rows, s);
    const bool masked = p0 + kChunk - 1 > diag || n < kChunk || p0 < band_end;
    for (int r = 0; r < rows; ++r) {
      float* sr = s[r];
      if (masked) {
        const int64_t visible = std::min<int64_t>(pos[r] - p0 + 1, n);   // keys j < visible
        const int64_t below = window ? pos[r] - window + 1 - p0 : 0;    // and j >= below
        for (int j = 0; j < kChunk; ++j)
          if (j >= visible || j < below) sr[j] = -std::numeric_limits<float>::infinity();
      }
      float cmax = sr[0];
      for (int j = 1; j < kChunk; ++j) cmax = std::max(cmax, sr[j]);
      if (cmax == -std::numeric_limits<float>::infinity()) continue;   // nothing visible
      const float mnew = std::max(m[r], cmax);
      const float alpha = exp_approx(m[r] - mnew);                     // 0 on the first chunk
      float psum = 0.f;
#pragma omp simd reduction(+ : psum)
      for (int j = 0; j < kChunk; ++j) {
        const float e = exp_approx(sr[j] - mnew);
        sr[j] = e;
        psum += e;
      }
      l[r] = l[r] * alpha + psum;
      m[r] = mnew;
      float* ar = acc[r];
      if (alpha != 1.f) {
#pragma omp simd
        for (int d = 0; d < DV; ++d) ar[d] *= alpha;
      }
      for (int j = 0; j < n; ++j) {
        const float pj = sr[j];
#pragma omp simd
        for (int d = 0; d < DV; ++d) ar[d] += pj * v[j][d];
      }
    }
  }
  for (int t = 0; t < it.ntok; ++t) {
    for (int gi = 0; gi < ng; ++gi) {
      const int r = t * ng + gi;
      const int64_t h = it.head * group + it.g0 + gi;
      const float inv = normalizer(m[r], l[r], sinks, h);
      T* dst = out + (q_start + it.tok0 + t) * o_tok_stride + h * o_head_stride;
      for (int d = 0; d < DV; ++d) dst[d] = static_cast<T>(acc[r][d] * inv);
    }
  }
}

}  // namespace paged
}  // namespace deltaserve_cpu
