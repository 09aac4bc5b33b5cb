// Streaming argmax and log-sum-exp of rows, fed in column pieces (one pass, 16 lanes).
//
// Each lane keeps the running max m, the sum s of e^(x - m) over what it has seen, and the
// first index where m occurred. Pieces must arrive in column order (ties then keep the first
// index); finish() folds the lanes (and other partial states) into the argmax and its
// log-softmax x[argmax] - log(sum e^x).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

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
    const int64_t full = n / kArgmaxLanes * kArgmaxLanes;
    for (int64_t i = 0; i < full; i += kArgmaxLanes) {
#pragma omp simd
      for (int l = 0; l < kArgmaxLanes; ++l) step(l, x[i + l], col0 + i + l);
    }
    for (int64_t i = full; i < n; ++i) step(0, x[i], col0 + i);
  }

  inline void step(int l, float xv, int64_t col) {
    const bool up = xv > m[l];
    const float hi = up ? xv : m[l];
    const float lo = up ? m[l] : xv;
    // e^(lo - hi); 0 while the lane has seen only -inf (-inf - -inf would be NaN)
    const float e = exp_approx(hi == -std::numeric_limits<float>::infinity() ? hi : lo - hi);
    s[l] = up ? s[l] * e + 1.0f : s[l] + e;
    idx[l] = up ? col : idx[l];
    m[l] = hi;
  }
};

// Fold `count` partial states of one row into (argmax, logprob). An all -inf row gives 0.
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
      if (parts[p].idx[l] >= 0)
        total += static_cast<double>(parts[p].s[l]) *
                 std::exp(static_cast<double>(parts[p].m[l] - best));
  *id_out = best_i;
  *lp_out = static_cast<float>(-std::log(total));
}

}  // namespace deltaserve_cpu
