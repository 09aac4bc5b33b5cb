// The model's small per-token operations, fused into one pass each (float32 or bfloat16
// activations; math in float32 with the same roundings as the torch reference in
// worker_service/layers, so bfloat16 results round where torch's ops do):
//
//   rms_norm(x, w, eps)                 y = w * (x / sqrt(mean(x^2) + eps))
//   add_rms_norm(x, residual, w, eps)   residual += x (in place), y = rms_norm(residual)
//   rope(positions, q, k, cos, sin)     q, k rotated in place ("rotate half" layout) over
//                                       the first cos.size(1) dims of each head; every
//                                       position in [0, cos.size(0)), one per token
//   silu_and_mul(x)                     [T, 2I] -> silu(x[:, :I]) * x[:, I:]
//   greedy_sample(logits, logprobs)     argmax per row (first index on ties) and its logprob,
//                                       one pass (an online max and sum of exponentials);
//                                       logprobs false: the argmax alone, no exponential
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#include "row_argmax.h"
#include "vec_math.h"

namespace deltaserve_cpu {
namespace {

inline float load(float x) { return x; }
inline float load(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// Round to nearest even, as c10::BFloat16 does (NaN aside).
inline float round_as(float f, float) { return f; }
inline float round_as(float f, c10::BFloat16) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  p->x = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

constexpr int64_t kGrain = 16;   // rows per parallel task at least

// One row of rms_norm: in (already the residual sum when fused) -> out.
template <typename T>
inline void norm_row(const T* in, const T* w, T* out, int64_t h, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) {
    const float v = load(in[i]);
    ss += v * v;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    const float n = round_as(load(in[i]) * inv, T{});     // x32 * rsqrt(...) .to(dtype)
    store(out + i, load(w[i]) * n);                        // weight * that, in dtype
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w,
                   double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), h = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* in = xp + r * h;
      if (rp) {
        T* res = rp + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) store(res + i, load(in[i]) + load(res[i]));
        in = res;
      }
      norm_row(in, wp, op + r * h, h, e);
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous 2-D tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "weight must be [hidden] in x's dtype");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, nullptr, weight, eps, out);
  else rms_norm_impl<c10::BFloat16>(x, nullptr, weight, eps, out);
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "weight must be [hidden] in x's dtype");
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) rms_norm_impl<float>(x, &residual, weight, eps, out);
  else rms_norm_impl<c10::BFloat16>(x, &residual, weight, eps, out);
  return out;
}

namespace {

// x [T, H, D] strided (D contiguous), rotated in place at each token's position. Only the
// first `rot` dims of each head rotate (rot == D, or less with a partial_rotary_factor:
// Phi-4-mini), in halves within them; dims rot .. D-1 are not touched. cos / sin rows are
// [rot] wide: [f, f].
template <typename T>
void rope_one(const int64_t* pos, T* x, int64_t tokens, int64_t heads, int64_t rot,
              int64_t tok_stride, int64_t head_stride, const float* cos, const float* sin) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* c = cos + pos[t] * rot;
      const float* s = sin + pos[t] * rot;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = x + t * tok_stride + h * head_stride;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(row[i]), x2 = load(row[i + half]);
          const float c1 = round_as(c[i], T{}), s1 = round_as(s[i], T{});
          const float c2 = round_as(c[i + half], T{}), s2 = round_as(s[i + half], T{});
          // q * cos + rotate_half(q) * sin, each product rounded to the dtype
          const float y1 = round_as(x1 * c1, T{}) + round_as(-x2 * s1, T{});
          const float y2 = round_as(x2 * c2, T{}) + round_as(x1 * s2, T{});
          store(row + i, y1);
          store(row + i + half, y2);
        }
      }
    }
  });
}

void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, name, " must be [T, H, D] with D contiguous");
}

// Every position must index a cos/sin row: the kernel reads the tables unchecked (the torch
// path's indexing raises IndexError). One pass over T int64s, before anything is rotated.
void check_positions(const int64_t* pos, int64_t tokens, int64_t max_position) {
  const uint64_t limit = static_cast<uint64_t>(max_position);   // a negative one wraps past it
  int64_t outside = 0;
#pragma omp simd reduction(+ : outside)
  for (int64_t t = 0; t < tokens; ++t) outside += static_cast<uint64_t>(pos[t]) >= limit;
  if (outside == 0) return;
  for (int64_t t = 0; t < tokens; ++t) {   // the first one outside, named
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "rope: positions[", t, "] = ", pos[t],
                " is outside the cos/sin caches' [0, ", max_position, ") (max_position)");
  }
}

}  // namespace

void rope(const at::Tensor& positions, at::Tensor query, at::Tensor key,
          const at::Tensor& cos_cache, const at::Tensor& sin_cache) {
  check_heads(query, "query");
  check_heads(key, "key");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be contiguous int64");
  TORCH_CHECK(key.size(2) == query.size(2), "key head_dim ", key.size(2),
              " must equal query's ", query.size(2));
  // The caches' width is the rotary dim: the first rot dims of each head rotate.
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
                  cos_cache.dim() == 2 && cos_cache.is_contiguous() &&
                  sin_cache.is_contiguous() && sin_cache.sizes() == cos_cache.sizes(),
              "cos/sin caches must be contiguous float32 [max_position, rotary_dim], equal shapes");
  const int64_t rot = cos_cache.size(1);
  TORCH_CHECK(rot >= 2 && rot % 2 == 0 && rot <= query.size(2), "cos/sin cache width ", rot,
              " (rotary_dim) must be even, in [2, head_dim=", query.size(2), "]");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  const int64_t tokens = positions.size(0);
  TORCH_CHECK(positions.dim() == 1 && query.size(0) == tokens && key.size(0) == tokens,
              "positions must be [T] with T = query's and key's tokens (", query.size(0), ", ",
              key.size(0), "), got ", positions.sizes());
  const int64_t* pos = positions.data_ptr<int64_t>();
  check_positions(pos, tokens, cos_cache.size(0));
  const float* c = cos_cache.data_ptr<float>();
  const float* s = sin_cache.data_ptr<float>();
  for (const at::Tensor* x : {&query, &key}) {
    if (x->scalar_type() == at::kFloat) {
      rope_one<float>(pos, x->data_ptr<float>(), tokens, x->size(1), rot, x->stride(0),
                      x->stride(1), c, s);
    } else {
      TORCH_CHECK(x->scalar_type() == at::kBFloat16, "rope: float32 or bfloat16 only");
      rope_one<c10::BFloat16>(pos, x->data_ptr<c10::BFloat16>(), tokens, x->size(1),
                              rot, x->stride(0), x->stride(1), c, s);
    }
  }
}

namespace {

template <typename T>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, kGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* g = xp + r * 2 * inter;
      const T* u = g + inter;
      T* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i)
        store(o + i, round_as(silu(load(g[i])), T{}) * load(u[i]));
    }
  });
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must have an even number of columns");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) silu_and_mul_impl<float>(x, out);
  else silu_and_mul_impl<c10::BFloat16>(x, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> greedy_sample(const at::Tensor& logits, bool logprobs) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [N, V] with contiguous rows");
  const int64_t n = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0, "logits need at least one column");
  at::Tensor ids = at::empty({n}, logits.options().dtype(at::kLong));
  at::Tensor lps = at::empty({logprobs ? n : 0}, logits.options());
  const float* x = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = logprobs ? lps.data_ptr<float>() : nullptr;
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    RowArgmax state;
    for (int64_t r = lo; r < hi; ++r) {
      state.reset();
      state.feed(x + r * stride, v, 0, logprobs);
      finish_rows(&state, 1, ip + r, lp ? lp + r : nullptr);
    }
  });
  return {ids, lps};
}

}  // namespace deltaserve_cpu
