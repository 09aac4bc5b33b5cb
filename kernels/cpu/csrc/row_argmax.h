// Streaming argmax and log-sum-exp of rows, fed in column pieces.
//
// Each of 16 lanes keeps the running max m, the sum s of e^(x - m) over what it has seen, and
// the first index where m occurred. Pieces must arrive in column order (ties then keep the first
// index); finish_rows() folds the lanes (and other partial states) into the argmax and its
// log-softmax x[argmax] - log(sum e^x).
//
// With AVX-512 a piece takes two passes (its max and first argmax, then the sum of e^(x - max))
// and is folded into lane 0: no exponential waits on the previous one, where the one-pass lane
// update chains max -> exp -> sum through every element (about 5x slower on an LM head's rows).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "vec_math.h"
#if defined(__AVX512F__)
#include "exp512.h"
#endif

namespace deltaserve_cpu {

constexpr int kArgmaxLanes = 16;

struct RowArgmax {
  float m[kArgmaxLanes];
  float s[kArgmaxLanes];
  int64_t idx[kArgmaxLanes];

  void reset() {
    for (int l = 0; l < kArgmaxLanes; ++l) {
      m[l] = -std::numeric_limits<float>::infinity();
      s[l] = 0.f;
      idx[l] = -1;
    }
  }

  // x[0 .. n) are the columns col0 .. col0 + n.
  void update(const float* x, int64_t n, int64_t col0) {
#if defined(__AVX512F__)
    if (update_two_pass(x, n, col0)) return;
    for (int64_t i = 0; i < n; ++i) step(0, x[i], col0 + i);
#else
    const int64_t full = n / kArgmaxLanes * kArgmaxLanes;
    for (int64_t i = 0; i < full; i += kArgmaxLanes) {
#pragma omp simd
      for (int l = 0; l < kArgmaxLanes; ++l) step(l, x[i + l], col0 + i + l);
    }
    for (int64_t i = full; i < n; ++i) step(0, x[i], col0 + i);
#endif
  }

#if defined(__AVX512F__)
  // The piece's max, its first index and sum e^(x - max), folded into lane 0. False (nothing
  // done) when the max is not finite (all -inf, NaN, +inf): the one-pass update handles those.
  bool update_two_pass(const float* x, int64_t n, int64_t col0) {
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512i step16 = _mm512_set1_epi32(kArgmaxLanes);
    __m512 vmax = neg_inf;
    __m512i vidx = _mm512_set1_epi32(-1);
    __m512i cols = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += kArgmaxLanes, cols = _mm512_add_epi32(cols, step16)) {
      const __m512 v = _mm512_mask_loadu_ps(neg_inf, live_lanes(n - i), x + i);
      const __mmask16 up = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmax = _mm512_mask_mov_ps(vmax, up, v);
      vidx = _mm512_mask_mov_epi32(vidx, up, cols);
    }
    const float pm = _mm512_reduce_max_ps(vmax);
    if (nan || !std::isfinite(pm)) return false;
    const __mmask16 at_max = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(pm), _CMP_EQ_OQ);
    const int64_t first = col0 + _mm512_mask_reduce_min_epi32(at_max, vidx);
    const __m512 shift = _mm512_set1_ps(pm);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 * kArgmaxLanes <= n; i += 2 * kArgmaxLanes) {
      // no NaN here (the first pass checked), and the piece's max contributes e^0 = 1
      acc0 = _mm512_add_ps(acc0, avx512::exp512_sum_term(_mm512_sub_ps(_mm512_loadu_ps(x + i),
                                                                        shift)));
      acc1 = _mm512_add_ps(acc1, avx512::exp512_sum_term(_mm512_sub_ps(
                                     _mm512_loadu_ps(x + i + kArgmaxLanes), shift)));
    }
    for (; i < n; i += kArgmaxLanes) {
      const __m512 v = _mm512_mask_loadu_ps(neg_inf, live_lanes(n - i), x + i);
      acc0 = _mm512_add_ps(acc0, avx512::exp512(_mm512_sub_ps(v, shift)));
    }
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    if (pm > m[0]) {   // also when lane 0 is empty (-inf): its s is 0
      s[0] = s[0] * std::exp(m[0] - pm) + sum;
      m[0] = pm;
      idx[0] = first;
    } else {           // an equal max seen earlier keeps its (earlier) index
      s[0] += sum * std::exp(pm - m[0]);
    }
    return true;
  }

  static __mmask16 live_lanes(int64_t left) {
    return left >= kArgmaxLanes ? static_cast<__mmask16>(0xFFFF)
                                : static_cast<__mmask16>((1u << left) - 1);
  }
#endif

  // A NaN is never the max but makes the lane's sum NaN (so the row's logprob is NaN, as
  // torch's logsumexp is), also when it is the first value the lane sees.
  inline void step(int l, float xv, int64_t col) {
    const bool up = xv > m[l];
    const float hi = up ? xv : m[l];
    const float lo = up ? m[l] : xv;
    // e^(lo - hi); 0 for lo = -inf (also when hi is -inf: -inf - -inf would be NaN)
    const float e = exp_approx(lo == -std::numeric_limits<float>::infinity() ? lo : lo - hi);
    const float sum = up ? s[l] * e + 1.0f : s[l] + e;
    s[l] = xv != xv ? xv : sum;
    idx[l] = up ? col : idx[l];
    m[l] = hi;
  }
};

// Fold `count` partial states of one row into (argmax, logprob). An all -inf row gives 0; a row
// with a NaN gives a NaN logprob.
inline void finish_rows(const RowArgmax* parts, int count, int64_t* id_out, float* lp_out) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0;
  for (int p = 0; p < count; ++p)
    for (int l = 0; l < kArgmaxLanes; ++l) {
      const float mv = parts[p].m[l];
      const int64_t iv = parts[p].idx[l];
      if (iv >= 0 && (mv > best || (mv == best && iv < best_i))) {
        best = mv;
        best_i = iv;
      }
    }
  double total = 0.0;
  for (int p = 0; p < count; ++p)
    for (int l = 0; l < kArgmaxLanes; ++l)
      if (parts[p].idx[l] >= 0 || parts[p].s[l] != parts[p].s[l])   // seen a number, or NaN
        total += static_cast<double>(parts[p].s[l]) *
                 std::exp(static_cast<double>(parts[p].m[l] - best));
  *id_out = best_i;
  *lp_out = static_cast<float>(-std::log(total));
}

}  // namespace deltaserve_cpu
