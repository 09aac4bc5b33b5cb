// Streaming argmax and log-sum-exp of rows, fed in column pieces.
//
// Each of 16 lanes keeps the running max m, the sum s of e^(x - m) over what it has seen, and
// the first index where m occurred. Pieces must arrive in column order (ties then keep the first
// index); finish_rows() folds the lanes (and other partial states) into the argmax and its
// log-softmax x[argmax] - log(sum e^x).
//
// update_argmax() keeps the max and its first index alone (no exponential): a step where no row
// wants its logprob.
//
// With AVX-512 or AVX2 (simd.h) a piece takes two passes (its max, then the sum of
// e^(x - max); the max's first index only when it beats lane 0's) and is folded into lane 0:
// no exponential waits on the previous one, where the one-pass lane update chains
// max -> exp -> sum through every element (about 5x slower on an LM head's rows). A generic
// build takes the lane-wise update throughout.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"
#include "vec_math.h"

namespace deltaserve_cpu {

constexpr int kArgmaxLanes = 16;

#if defined(DELTASERVE_SIMD)
// The first i < n with x[i] == v; v must occur in x[0 .. n).
inline int64_t first_equal(const float* x, int64_t n, float v) {
  using namespace simd;
  const vf target = set1(v);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    if (any(eq(loadu(x + i), target))) break;
  for (; i < n; ++i)
    if (x[i] == v) return i;
  return n - 1;   // not reached
}

// The largest number in x[0 .. n) (NaN skipped; -inf when there is none) and, when saw_nan is
// given, whether x holds a NaN. Four independent maxima (no blend, no index), a plain load for
// every full vector. max(v, acc) returns acc when v is NaN, so a NaN never enters the maxima.
inline float piece_max(const float* x, int64_t n, bool* saw_nan) {
  using namespace simd;
  const vf neg_inf = set1(-std::numeric_limits<float>::infinity());
  vf mx[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
  mask nan = is_nan(zero());
  const int64_t full = n / kLanes * kLanes;
  int64_t i = 0;
  for (; i + 4 * kLanes <= full; i += 4 * kLanes)
    for (int a = 0; a < 4; ++a) {
      const vf v = loadu(x + i + a * kLanes);
      if (saw_nan) nan = mask_or(nan, is_nan(v));
      mx[a] = max(v, mx[a]);
    }
  for (; i < n; i += kLanes) {
    const vf v = i < full ? loadu(x + i) : loadu_first(x + i, n - i, neg_inf);
    if (saw_nan) nan = mask_or(nan, is_nan(v));
    mx[0] = max(v, mx[0]);
  }
  if (saw_nan) *saw_nan = any(nan);
  return reduce_max(max(max(mx[0], mx[1]), max(mx[2], mx[3])));
}
#endif

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

  // update() with the log-sum-exp, else update_argmax(): what the greedy kernels feed.
  void feed(const float* x, int64_t n, int64_t col0, bool with_sum) {
    if (with_sum) update(x, n, col0);
    else update_argmax(x, n, col0);
  }

  // The max and its first index only (NaN is never the max, as in update()); the lanes' sums
  // stay 0, so finish_rows must not be asked for a logprob.
  void update_argmax(const float* x, int64_t n, int64_t col0) {
#if defined(DELTASERVE_SIMD)
    const float pm = piece_max(x, n, nullptr);
    if (pm > m[0]) {   // an equal max seen earlier keeps its (earlier) index
      m[0] = pm;
      idx[0] = col0 + first_equal(x, n, pm);
    }
#else
    const int64_t full = n / kArgmaxLanes * kArgmaxLanes;
    for (int64_t i = 0; i < full; i += kArgmaxLanes) {
#pragma omp simd
      for (int l = 0; l < kArgmaxLanes; ++l) {
        const bool up = x[i + l] > m[l];
        m[l] = up ? x[i + l] : m[l];
        idx[l] = up ? col0 + i + l : idx[l];
      }
    }
    for (int64_t i = full; i < n; ++i)
      if (x[i] > m[0]) {
        m[0] = x[i];
        idx[0] = col0 + i;
      }
#endif
  }

#if defined(DELTASERVE_SIMD)
  // The piece's max, its first index and sum e^(x - max), folded into lane 0. False (nothing
  // done) when the piece holds a NaN or its max is not finite (all -inf, +inf): the one-pass
  // update handles those.
  //
  // The first index of the max is looked for only when it beats lane 0's (over an LM head's
  // ~100 tiles a row's max improves a few times). With AVX2's blend-based selects and masked
  // tail loads on every vector the max pass had cost as much as the exponentials.
  bool update_two_pass(const float* x, int64_t n, int64_t col0) {
    using namespace simd;
    const vf neg_inf = set1(-std::numeric_limits<float>::infinity());
    bool saw_nan = false;
    const float pm = piece_max(x, n, &saw_nan);
    if (saw_nan || !std::isfinite(pm)) return false;
    // needed only when lane 0 takes pm (an equal max seen earlier keeps its index)
    const int64_t first = pm > m[0] ? col0 + first_equal(x, n, pm) : -1;
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
// with a NaN gives a NaN logprob. lp_out null: the argmax alone (states fed by update_argmax).
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
  *id_out = best_i;
  if (!lp_out) return;
  double total = 0.0;
  for (int p = 0; p < count; ++p)
    for (int l = 0; l < kArgmaxLanes; ++l)
      if (parts[p].idx[l] >= 0 || parts[p].s[l] != parts[p].s[l])   // seen a number, or NaN
        total += static_cast<double>(parts[p].s[l]) *
                 std::exp(static_cast<double>(parts[p].m[l] - best));
  *lp_out = static_cast<float>(-std::log(total));
}

}  // namespace deltaserve_cpu
