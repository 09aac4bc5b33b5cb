// A mixture-of-experts layer's routed experts in one call (worker_service/layers/moe.py on the
// CPU): every expert's weights stay packed in the panels of panel_gemm.cpp, and
//
//   1. the (token, slot) pairs are grouped by expert (stable: token order within an expert),
//      each pair's row of x copied into one float32 block, so an expert's rows are contiguous;
//   2. gate_up = x W13_e^T for every expert that received rows: the (expert, panel) pairs are
//      split between the threads, so one layer's experts share a single parallel region (a
//      decode step spreads its few rows over many experts: per-expert GEMM calls would each
//      pay a thread fork and join, and F.linear's few-row GEMMs stream the weight slowly);
//   3. silu(gate) * up, row by row (or GPT-OSS's clamped SwiGLU, below), after adding the
//      expert's gate_up bias when there is one;
//   4. down = act W2_e^T, split the same way, plus the expert's down bias when there is one;
//   5. out[t] = sum over t's slots of weight * down, in slot order.
//
// GPT-OSS (worker_service/layers/gpt_oss_moe.py): g = min(gate, limit), u = clamp(up, -limit,
// limit), act = (u + 1) * g * sigmoid(alpha g), with per-expert biases [E, 2I] and [E, H]
// (float32). Without biases and with silu the path is the one the other MoE models always took.
//
// Experts without rows are never read. bfloat16 rounds where the torch path does (gate_up,
// silu, the product, down, the weighted sum: F.linear, silu_and_mul, bmm in bfloat16; each
// elementwise op of the clamped SwiGLU); float32 needs no rounding. Weights are the experts'
// panel_pack outputs stacked [E, panels, K, 32].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace deltaserve_cpu {

void panel_rows(const float* x, int64_t m, int64_t k, const float* panel, const float* next,
                float* y, int64_t ldy, int cols, float* acc);
void panel_rows(const float* x, int64_t m, int64_t k, const c10::BFloat16* panel,
                const c10::BFloat16* next, float* y, int64_t ldy, int cols, float* acc);

namespace {

constexpr int64_t kPanel = 32;

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
// float32 -> the layer's dtype and back (round to nearest even for bfloat16, as c10 does)
inline float rounded(float v, bool bf16) {
  return bf16 ? static_cast<float>(c10::BFloat16(v)) : v;
}

// The pairs grouped by expert: rows start[e] .. start[e + 1] belong to expert e.
struct Groups {
  std::vector<int64_t> start;      // [E + 1]
  std::vector<int64_t> row_of;     // [T * k]: the grouped row of pair (t, s)
  std::vector<int64_t> token_of;   // [T * k]: the token of grouped row r
  std::vector<int64_t> expert_of;  // [T * k]: the expert of grouped row r
  std::vector<int64_t> active;     // experts with rows, ascending
  int64_t max_rows = 0;
};

Groups group_pairs(const int64_t* ids, int64_t pairs, int64_t top_k, int64_t experts) {
  Groups g;
  g.start.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < experts, "expert id ", ids[i], " is out of range [0, ",
                experts, ")");
    ++g.start[static_cast<size_t>(ids[i] + 1)];
  }
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = g.start[e + 1];
    if (n > 0) g.active.push_back(e);
    g.max_rows = std::max(g.max_rows, n);
    g.start[e + 1] += g.start[e];
  }
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  g.row_of.resize(static_cast<size_t>(pairs));
  g.token_of.resize(static_cast<size_t>(pairs));
  g.expert_of.resize(static_cast<size_t>(pairs));
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t r = next[ids[i]]++;
    g.row_of[i] = r;
    g.token_of[r] = i / top_k;
    g.expert_of[r] = ids[i];
  }
  return g;
}

// y[rows of e] = x[rows of e] W_e^T for every active expert e; x [pairs, k] float32, W_e as
// panels [np, k, 32] at panels + e * np * k * 32, y [pairs, n] float32.
template <typename W>
void experts_gemm(const Groups& g, const float* x, int64_t k, const W* panels, int64_t n,
                  float* y) {
  const int64_t np = (n + kPanel - 1) / kPanel;
  const int64_t items = static_cast<int64_t>(g.active.size()) * np;
  auto panel_of = [&](int64_t it) {
    return panels + (g.active[it / np] * np + it % np) * k * kPanel;
  };
  at::parallel_for(0, items, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc_buf(static_cast<size_t>(g.max_rows * kPanel) + 16);
    float* acc = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(acc_buf.data()) + 63) & ~uintptr_t{63});
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t e = g.active[it / np], p = it % np;
      const int64_t r0 = g.start[e], rows = g.start[e + 1] - r0;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
      panel_rows(x + r0 * k, rows, k, panel_of(it), it + 1 < hi ? panel_of(it + 1) : nullptr,
                 y + r0 * n + p * kPanel, n, cols, acc);
    }
  });
}

// What runs around the two GEMMs: optional per-expert biases, silu or the clamped SwiGLU.
struct Epilogue {
  const float* w13_bias = nullptr;   // [E, 2I] or none
  const float* w2_bias = nullptr;    // [E, H] or none
  bool clamped = false;              // GPT-OSS's clamped SwiGLU instead of silu(gate) * up
  float alpha = 0.f, limit = 0.f;
};

// y[r] += bias[expert of r], y [pairs, n] float32, bias [E, n].
void add_bias(const Groups& g, const float* bias, int64_t n, float* y) {
  const int64_t pairs = static_cast<int64_t>(g.expert_of.size());
  at::parallel_for(0, pairs, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* b = bias + g.expert_of[r] * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y[r * n + i] += b[i];
    }
  });
}

// act[r] = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit), rounded
// after each op as torch's bfloat16 elementwise ops round (gpt_oss_moe.clamped_swiglu).
void clamped_swiglu_rows(const float* h13, int64_t pairs, int64_t inter, float alpha,
                         float limit, bool bf16, float* act) {
  at::parallel_for(0, pairs, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* gate = h13 + r * 2 * inter;
      const float* up = gate + inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float g = rounded(std::min(rounded(gate[i], bf16), limit), bf16);
        const float u = rounded(std::max(std::min(rounded(up[i], bf16), limit), -limit), bf16);
        const float s = rounded(sigmoid(rounded(g * alpha, bf16)), bf16);
        act[r * inter + i] = rounded(rounded(u + 1.f, bf16) * rounded(g * s, bf16), bf16);
      }
    }
  });
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& weights, const Groups& g, int64_t top_k,
         const at::Tensor& w13, const at::Tensor& w2, int64_t inter, const Epilogue& ep,
         at::Tensor& out) {
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  const int64_t tokens = x.size(0), hidden = x.size(1), pairs = tokens * top_k;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor xg = at::empty({pairs, hidden}, f32), h13 = at::empty({pairs, 2 * inter}, f32);
  at::Tensor act = at::empty({pairs, inter}, f32), down = at::empty({pairs, hidden}, f32);
  const T* xp = x.data_ptr<T>();
  float *xgp = xg.data_ptr<float>(), *hp = h13.data_ptr<float>();
  float *ap = act.data_ptr<float>(), *dp = down.data_ptr<float>();
  at::parallel_for(0, pairs, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* src = xp + g.token_of[r] * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) xgp[r * hidden + i] = widen(src[i]);
    }
  });
  experts_gemm(g, xgp, hidden, w13.data_ptr<T>(), 2 * inter, hp);
  if (ep.w13_bias != nullptr) add_bias(g, ep.w13_bias, 2 * inter, hp);
  if (ep.clamped) clamped_swiglu_rows(hp, pairs, inter, ep.alpha, ep.limit, bf16, ap);
  else at::parallel_for(0, pairs, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* gate = hp + r * 2 * inter;
      const float* up = gate + inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i)
        ap[r * inter + i] = rounded(
            rounded(silu(rounded(gate[i], bf16)), bf16) * rounded(up[i], bf16), bf16);
    }
  });
  experts_gemm(g, ap, inter, w2.data_ptr<T>(), hidden, dp);
  if (ep.w2_bias != nullptr) add_bias(g, ep.w2_bias, hidden, dp);
  at::Tensor w = weights.to(at::kFloat).contiguous();
  const float* wp = w.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, 4, [&](int64_t lo, int64_t hi) {
    std::vector<float> sum(static_cast<size_t>(hidden));
    for (int64_t t = lo; t < hi; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t s = 0; s < top_k; ++s) {
        const float ws = wp[t * top_k + s];
        const float* d = dp + g.row_of[t * top_k + s] * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) sum[i] += ws * rounded(d[i], bf16);
      }
      for (int64_t i = 0; i < hidden; ++i) op[t * hidden + i] = static_cast<T>(sum[i]);
    }
  });
}

// A bias's float32 data after checking it is contiguous float32 [experts, n]; none: nullptr.
const float* bias_data(const std::optional<at::Tensor>& bias, int64_t experts, int64_t n,
                       const char* name) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                  bias->is_contiguous() && bias->dim() == 2 && bias->size(0) == experts &&
                  bias->size(1) == n,
              name, " must be a contiguous float32 CPU tensor [", experts, ", ", n, "], got ",
              bias->scalar_type(), " ", bias->sizes(), " on ", bias->device());
  return bias->data_ptr<float>();
}

Epilogue epilogue(const std::optional<at::Tensor>& w13_bias,
                  const std::optional<at::Tensor>& w2_bias, c10::string_view activation,
                  double alpha, double limit, int64_t experts, int64_t hidden, int64_t inter) {
  Epilogue ep;
  ep.w13_bias = bias_data(w13_bias, experts, 2 * inter, "w13_bias");
  ep.w2_bias = bias_data(w2_bias, experts, hidden, "w2_bias");
  ep.clamped = activation == "clamped_swiglu";
  TORCH_CHECK(ep.clamped || activation == "silu", "activation='", activation,
              "' is not one of 'silu', 'clamped_swiglu'");
  TORCH_CHECK(!ep.clamped || (std::isfinite(alpha) && !std::isnan(limit) && limit >= 0),
              "clamped_swiglu needs a finite alpha and a limit >= 0, got alpha=", alpha,
              " limit=", limit);
  ep.alpha = static_cast<float>(alpha);
  ep.limit = static_cast<float>(limit);
  return ep;
}

}  // namespace

// x [T, H], weights [T, k] (x's dtype), ids [T, k] int64, w13_panels [E, ceil(2I / 32), H, 32],
// w2_panels [E, ceil(H / 32), I, 32] (x's dtype: float32 or bfloat16) -> [T, H] in x's dtype.
// Optional float32 biases w13_bias [E, 2I], w2_bias [E, H]; activation "silu" (silu(gate) * up)
// or "clamped_swiglu" (GPT-OSS's, with alpha and limit).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const at::Tensor& w13_panels, const at::Tensor& w2_panels, int64_t inter,
                       const std::optional<at::Tensor>& w13_bias,
                       const std::optional<at::Tensor>& w2_bias, c10::string_view activation,
                       double alpha, double limit) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "x must be a contiguous float32 or bfloat16 [T, H] tensor");
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == tokens && ids.scalar_type() == at::kLong &&
                  weights.sizes() == ids.sizes(),
              "ids must be int64 [T, k] and weights [T, k]");
  TORCH_CHECK(w13_panels.dim() == 4 && w2_panels.dim() == 4 && w13_panels.is_contiguous() &&
                  w2_panels.is_contiguous() && w13_panels.scalar_type() == dtype &&
                  w2_panels.scalar_type() == dtype, "panels must be contiguous 4-D in x's dtype");
  const int64_t experts = w13_panels.size(0);
  TORCH_CHECK(inter > 0 && w2_panels.size(0) == experts &&
                  w13_panels.size(1) == (2 * inter + kPanel - 1) / kPanel &&
                  w13_panels.size(2) == hidden && w13_panels.size(3) == kPanel &&
                  w2_panels.size(1) == (hidden + kPanel - 1) / kPanel &&
                  w2_panels.size(2) == inter && w2_panels.size(3) == kPanel,
              "panels do not match x and inter");
  const Epilogue ep = epilogue(w13_bias, w2_bias, activation, alpha, limit, experts, hidden,
                               inter);
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  const int64_t top_k = ids.size(1);
  if (tokens == 0 || top_k == 0) return out.zero_();
  at::Tensor flat = ids.contiguous();
  const Groups g = group_pairs(flat.data_ptr<int64_t>(), tokens * top_k, top_k, experts);
  if (dtype == at::kFloat) run<float>(x, weights, g, top_k, w13_panels, w2_panels, inter, ep, out);
  else run<c10::BFloat16>(x, weights, g, top_k, w13_panels, w2_panels, inter, ep, out);
  return out;
}

}  // namespace deltaserve_cpu
