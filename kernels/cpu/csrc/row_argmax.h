// Streaming argmax and log-sum-exp of rows, fed in column pieces.
//
// Each of 16 lanes keeps the running max m, the sum s of e^(x - m) over what it has seen, and
// the first index where m occurred. Pieces must arrive in column order (ties then keep the first
// index); finish_rows() folds the lanes (and other partial states) into the argmax and its
// log-softmax x[argmax] - log(sum e^x).
//
// With AVX-512 or AVX2 (simd.h) a piece takes two passes (its max and first argmax, then the
// sum of e^(x - max)) and is folded into lane 0: no exponential waits on the previous one, where
// the one-pass lane update chains max -> exp -> sum through every element (about 5x slower on
// an LM head's rows). A generic build takes the lane-wise update throughout.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"
#include "vec_math.h"

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
#if defined(DELTASERVE_SIMD)
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

#if defined(DELTASERVE_SIMD)
  // The piece's max, its first index and sum e^(x - max), folded into lane 0. False (nothing
  // done) when the max is not finite (all -inf, NaN, +inf): the one-pass update handles those.
  bool update_two_pass(const float* x, int64_t n, int64_t col0) {
    using namespace simd;
    const vf neg_inf = set1(-std::numeric_limits<float>::infinity());
    const vi step = set1_i(kLanes);
    vf vmax = neg_inf;
    vi vidx = set1_i(-1);
    vi cols = iota();
    mask nan = is_nan(zero());
    for (int64_t i = 0; i < n; i += kLanes, cols = add_i(cols, step)) {
      const vf v = loadu_first(x + i, n - i, neg_inf);
      const mask up = gt(v, vmax);
      nan = mask_or(nan, is_nan(v));
      vmax = select(up, vmax, v);
      vidx = select_i(up, vidx, cols);
    }
    const float pm = reduce_max(vmax);
    if (any(nan) || !std::isfinite(pm)) return false;
    alignas(64) float lane_max[kLanes];
    alignas(64) int32_t lane_idx[kLanes];
    storeu(lane_max, vmax);
    storeu_i(lane_idx, vidx);
    int32_t first_col = -1;
    for (int l = 0; l < kLanes; ++l)
      if (lane_max[l] == pm && (first_col < 0 || lane_idx[l] < first_col)) first_col = lane_idx[l];
    const int64_t first = col0 + first_col;
    const vf shift = set1(pm);
    vf acc0 = zero(), acc1 = zero();
    int64_t i = 0;
    for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
      // no NaN here (the first pass checked), and the piece's max contributes e^0 = 1
      acc0 = add(acc0, exp_sum_term(sub(loadu(x + i), shift)));
      acc1 = add(acc1, exp_sum_term(sub(loadu(x + i + kLanes), shift)));
    }
    for (; i < n; i += kLanes)
      acc0 = add(acc0, simd::exp(sub(loadu_first(x + i, n - i, neg_inf), shift)));
    const float sum = reduce_add(add(acc0, acc1));
    if (pm > m[0]) {   // also when lane 0 is empty (-inf): its s is 0
      s[0] = s[0] * std::exp(m[0] - pm) + sum;
      m[0] = pm;
      idx[0] = first;
    } else {           // an equal max seen earlier keeps its (earlier) index
      s[0] += sum * std::exp(pm - m[0]);
    }
    return true;
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
