// Small math helpers written so that GCC vectorizes them inside `#pragma omp simd` loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace deltaserve_cpu {

// e^x for x <= 0 (the softmax's only case; -inf and anything below -87 give 0), relative error
// about 2e-7: x = k ln2 + f with |f| <= ln2/2, e^f by its degree-7 Taylor polynomial, 2^k
// built in the exponent bits.
inline float exp_approx(float x) {
  const bool tiny = x < -87.0f;
  x = tiny ? -87.0f : x;
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round(x / ln2)
  const float f = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;  // x - k ln2
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

// silu(g) = g / (1 + e^-g), computed with e^-|g| only (exp_approx takes arguments <= 0); shared
// by silu_and_mul (elementwise.cpp) and the MoE experts (moe_experts.cpp), so both round alike.
inline float silu(float g) {
  const float e = exp_approx(-std::fabs(g));
  const float sig = g >= 0.f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return g * sig;
}

// sigmoid(z) = 1 / (1 + e^-z), the same way (GPT-OSS's clamped SwiGLU in moe_experts.cpp).
inline float sigmoid(float z) {
  const float e = exp_approx(-std::fabs(z));
  return z >= 0.f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// The factor a row's accumulator (sums relative to its running max m, total l) is scaled by to
// become its output: 1 / l, or with a sink logit 1 / (l + e^(sink - m)), computed against
// max(m, sink) so that neither exponential overflows.
inline float normalizer(float m, float l, const float* sinks, int64_t head) {
  if (sinks == nullptr) return 1.f / l;
  const float sink = sinks[head];
  const float top = std::max(m, sink);
  const float keep = std::exp(m - top);
  return keep / (l * keep + std::exp(sink - top));
}

}  // namespace deltaserve_cpu
