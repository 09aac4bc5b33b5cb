// y = x W^T + b for few rows (decode steps): W repacked once into panels of 32 output columns,
//
//     panels[p][k][0..31] = W[32 p + 0..31][k]   (zero rows past N), float32 or bfloat16
//
// so that each panel streams from memory exactly once per call, contiguously, with the next
// panel prefetched, while up to kRows rows of x accumulate against it in vector registers
// (AVX-512: 12 rows x 32 columns in 24 registers; AVX2: 3 rows in 12; simd.h). More rows walk
// the panel in chunks of kKChunk values of k, every row block (AVX2: 6 rows over each half of
// the panel) taking the chunk while it is in L1 (partial sums parked in a small buffer), the
// next panel's chunk prefetched a slice per block and column group. For 4-47 rows (AVX2: to a
// few hundred) this beats MKL's packed GEMM by streaming W at close to the memory bandwidth; a
// bfloat16 W is widened in registers, so it streams half the bytes. Larger row counts go to MKL
// or oneDNN (kernels/cpu/linear.py's PANEL_MAX_ROWS: on an AVX2 core from 97 rows with oneDNN,
// 257 with MKL), except a long
// prefill's MoE experts, whose panels are their only copy (kernels/cpu/moe_experts.py): their
// rows are taken in L2-sized slices of x, each slice walking the panels.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace deltaserve_cpu {
namespace {

constexpr int kPanel = 32;   // output columns per panel
constexpr int kKChunk = 64;  // k values per chunk when several row blocks share a panel
constexpr int64_t kSliceBytes = 256 * 1024;  // float32 x per row slice (panel_gemm)
constexpr int64_t kSliceMinRows = 96;        // never fewer rows a slice (decode: one slice)

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

#if defined(DELTASERVE_SIMD)
using namespace simd;
constexpr int kVecs = kPanel / kLanes;       // vectors per panel row: 2 (AVX-512), 4 (AVX2)
constexpr int kRows = kRegs == 32 ? 12 : 3;  // rows of x per register block: 24 or 12 accumulators
// The chunked path (more than kRows rows) takes the panel two vectors wide: the whole panel on
// AVX-512 (12 rows, 24 accumulators), a half on AVX2, where 6 rows x 2 vectors leave registers
// for the two weight vectors and the broadcast. The AVX2 full-width block (3 rows x 4 vectors)
// has no register left for the broadcast: its FMAs read the weights from L1, 15 loads for 12
// FMAs, and it ran at ~60% of the core's FMA peak (52-58 of 89 GFLOP/s, Zen 4 without AVX-512).
constexpr int kChunkVecs = 2;
constexpr int kChunkGroups = kVecs / kChunkVecs;  // column groups of a panel: 1 or 2
constexpr int kChunkRows = kRegs == 32 ? 12 : 6;

// y[r][0..cols) = sum_k x[r][k] * panel[k][0..cols) for r < R (x float32, row stride ldx).
template <int R, typename W>
inline void block(const float* x, int64_t ldx, const W* panel, const W* next, int64_t k,
                  float* y, int64_t ldy, int cols) {
  vf a[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) a[r][v] = zero();
  constexpr int kLineElems = 64 / sizeof(W);
  for (int64_t kk = 0; kk < k; ++kk) {
    if (next != nullptr) {
      const char* ahead = reinterpret_cast<const char*>(next + kk * kPanel);
      for (int off = 0; off < kPanel; off += kLineElems)
        _mm_prefetch(ahead + off * sizeof(W), _MM_HINT_T0);
    }
    vf w[kVecs];
    for (int v = 0; v < kVecs; ++v) w[v] = load(panel + kk * kPanel + v * kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const vf b = set1(x[r * ldx + kk]);
      for (int v = 0; v < kVecs; ++v) a[r][v] = fmadd(b, w[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v)
      storeu_first(y + r * ldy + v * kLanes, a[r][v], cols - v * kLanes);
}

// acc[r][0..2 vectors) (+)= sum_{k0 <= kk < k1} x[r][kk] * panel[kk][..] for r < R, panel and acc
// pointing at one column group (rows kPanel apart); issues `lines` prefetches from pf (one per
// k step while they last).
template <int R, typename W>
inline void chunk_block(const float* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1,
                        float* acc, bool first, const char* pf, int lines) {
  vf a[R][kChunkVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kChunkVecs; ++v)
      a[r][v] = first ? zero() : load(acc + r * kPanel + v * kLanes);
  for (int64_t kk = k0; kk < k1; ++kk) {
    if (lines > 0) {
      _mm_prefetch(pf, _MM_HINT_T0);
      pf += 64;
      --lines;
    }
    vf w[kChunkVecs];
    for (int v = 0; v < kChunkVecs; ++v) w[v] = load(panel + kk * kPanel + v * kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const vf b = set1(x[r * ldx + kk]);
      for (int v = 0; v < kChunkVecs; ++v) a[r][v] = fmadd(b, w[v], a[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kChunkVecs; ++v) store(acc + r * kPanel + v * kLanes, a[r][v]);
}

template <typename W>
using BlockFn = void (*)(const float*, int64_t, const W*, const W*, int64_t, float*, int64_t,
                         int);
template <typename W>
using ChunkFn = void (*)(const float*, int64_t, const W*, int64_t, int64_t, float*, bool,
                         const char*, int);

// [i] = the body for i + 1 rows
template <typename W, size_t... R>
constexpr auto block_table(std::index_sequence<R...>) {
  return std::array<BlockFn<W>, sizeof...(R)>{block<static_cast<int>(R) + 1, W>...};
}
template <typename W, size_t... R>
constexpr auto chunk_table(std::index_sequence<R...>) {
  return std::array<ChunkFn<W>, sizeof...(R)>{chunk_block<static_cast<int>(R) + 1, W>...};
}

// More than kRows rows: the panel in k chunks shared by every row block while in L1. A
// bfloat16 chunk is widened once into a float32 copy that every row block then reads: widened
// in each block instead, the AVX2 body (3 rows a block) spent as many instructions widening as
// multiplying (bf16 panels 12 GFLOP/s at 16-128 rows against float32's 35-45 on an AVX2 EPYC).
template <typename W>
void rows_against_panel_chunked(const float* x, int64_t m, int64_t k, const W* panel,
                                const W* next, float* y, int64_t ldy, int cols, float* acc) {
  static constexpr auto fns = chunk_table<float>(std::make_index_sequence<kChunkRows>{});
  alignas(64) float wide[std::is_same_v<W, float> ? 1 : kKChunk * kPanel];
  const int64_t blocks = (m + kChunkRows - 1) / kChunkRows;
  const int64_t calls = blocks * kChunkGroups;
  for (int64_t k0 = 0; k0 < k; k0 += kKChunk) {
    const int64_t k1 = std::min(k, k0 + kKChunk);
    const int lines = next ? static_cast<int>((k1 - k0) * kPanel * sizeof(W) / 64) : 0;
    const int per_call = static_cast<int>((lines + calls - 1) / calls);
    const char* pf = next ? reinterpret_cast<const char*>(next + k0 * kPanel) : nullptr;
    // the chunk as float32 rows [c0, c1) of `src`, x's columns shifted to match
    const float* src;
    int64_t c0 = k0, c1 = k1, shift = 0;
    if constexpr (std::is_same_v<W, float>) {
      src = panel;
    } else {
      for (int64_t i = 0; i < (k1 - k0) * kPanel; i += kLanes)
        store(wide + i, load(panel + k0 * kPanel + i));
      src = wide, c0 = 0, c1 = k1 - k0, shift = k0;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      // rows split evenly over the blocks (8 rows: 4 + 4, not 6 + 2): a block of few rows has
      // too few independent accumulators to cover the FMA latency
      const int64_t r0 = b * m / blocks;
      const int rows = static_cast<int>((b + 1) * m / blocks - r0);
      for (int g = 0; g < kChunkGroups; ++g) {
        const int64_t c = b * kChunkGroups + g, col = g * kChunkVecs * kLanes;
        const int mine = std::max(0, std::min(per_call, lines - static_cast<int>(c) * per_call));
        fns[rows - 1](x + r0 * k + shift, k, src + col, c0, c1, acc + r0 * kPanel + col,
                      k0 == 0, pf ? pf + c * per_call * 64 : nullptr, mine);
      }
    }
  }
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(y + r * ldy, acc + r * kPanel, sizeof(float) * cols);
}

template <typename W>
void rows_against_panel(const float* x, int64_t m, int64_t k, const W* panel, const W* next,
                        float* y, int64_t ldy, int cols, float* acc) {
  if (m > kRows) {
    rows_against_panel_chunked(x, m, k, panel, next, y, ldy, cols, acc);
    return;
  }
  static constexpr auto fns = block_table<W>(std::make_index_sequence<kRows>{});
  if (m > 0) fns[m - 1](x, k, panel, next, k, y, ldy, cols);
}
#else
template <typename W>
void rows_against_panel(const float* x, int64_t m, int64_t k, const W* panel, const W*,
                        float* y, int64_t ldy, int cols, float*) {
  for (int64_t r = 0; r < m; ++r) {
    float acc[kPanel] = {};
    for (int64_t kk = 0; kk < k; ++kk) {
      const float xv = x[r * k + kk];
#pragma omp simd
      for (int c = 0; c < kPanel; ++c) acc[c] += xv * widen(panel[kk * kPanel + c]);
    }
    std::memcpy(y + r * ldy, acc, sizeof(float) * cols);
  }
}
#endif

template <typename W>
void panel_gemm(const float* x, int64_t m, int64_t k, const W* panels, int64_t n, float* y) {
  const int64_t np = (n + kPanel - 1) / kPanel;
  // many rows (a long prefill's experts) in slices of ~256 KiB of x, each walking the thread's
  // panels: the slice stays in L2, where x whole would come from L3 once per panel
  // (k = 0 counted as 1: no division by zero)
  const int64_t slice =
      std::max<int64_t>(kSliceMinRows, kSliceBytes / (4 * std::max<int64_t>(1, k)));
  at::parallel_for(0, np, 1, [&](int64_t lo, int64_t hi) {
    const int64_t rows = std::min(m, slice);
    std::vector<float> acc_buf(static_cast<size_t>(rows * kPanel) + 16);
    float* acc = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(acc_buf.data()) + 63) & ~uintptr_t{63});
    for (int64_t s0 = 0; s0 < m; s0 += slice) {
      const int64_t s1 = std::min(m, s0 + slice);
      for (int64_t p = lo; p < hi; ++p) {
        const W* panel = panels + p * k * kPanel;
        const W* next = p + 1 < hi ? panel + k * kPanel : nullptr;
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        rows_against_panel(x + s0 * k, s1 - s0, k, panel, next, y + s0 * n + p * kPanel, n,
                           cols, acc);
      }
    }
  });
}

template <typename W>
void pack_impl(const W* src, int64_t n, int64_t k, W* dst) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) dst[((i / kPanel) * k + j) * kPanel + i % kPanel] = src[i * k + j];
}

}  // namespace

// One panel against m rows of x for another file's loop (moe_experts.cpp): y[r][0..cols) =
// x[r] . panel[..][0..cols), x [m, k] contiguous float32, acc a 64-byte aligned scratch of m * 32
// floats; next (or nullptr) is the panel to prefetch.
void panel_rows(const float* x, int64_t m, int64_t k, const float* panel, const float* next,
                float* y, int64_t ldy, int cols, float* acc) {
  rows_against_panel(x, m, k, panel, next, y, ldy, cols, acc);
}
void panel_rows(const float* x, int64_t m, int64_t k, const c10::BFloat16* panel,
                const c10::BFloat16* next, float* y, int64_t ldy, int cols, float* acc) {
  rows_against_panel(x, m, k, panel, next, y, ldy, cols, acc);
}

// weight [N, K] (float32 or bfloat16) -> panels [ceil(N / 32), K, 32], same dtype.
at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be contiguous [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor panels = at::zeros({(n + kPanel - 1) / kPanel, k, kPanel}, weight.options());
  if (weight.scalar_type() == at::kFloat) {
    pack_impl(weight.data_ptr<float>(), n, k, panels.data_ptr<float>());
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "weight must be float32 or bfloat16");
    pack_impl(weight.data_ptr<c10::BFloat16>(), n, k, panels.data_ptr<c10::BFloat16>());
  }
  return panels;
}

// x [M, K] in the weight's dtype -> [M, n] in that dtype (float32 accumulation, bias added in
// float32, one rounding for bfloat16).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == panels.scalar_type(),
              "x must be contiguous [M, K] in the panels' dtype");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == x.size(1) && panels.size(2) == kPanel &&
                  panels.size(0) == (n + kPanel - 1) / kPanel, "panels do not match x and n");
  const int64_t m = x.size(0), k = x.size(1);
  const bool f32 = x.scalar_type() == at::kFloat;
  at::Tensor x32 = f32 ? x : x.to(at::kFloat);
  at::Tensor y32 = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m > 0) {
    if (f32) {
      panel_gemm(x32.data_ptr<float>(), m, k, panels.data_ptr<float>(), n,
                 y32.data_ptr<float>());
    } else {
      panel_gemm(x32.data_ptr<float>(), m, k, panels.data_ptr<c10::BFloat16>(), n,
                 y32.data_ptr<float>());
    }
  }
  if (bias.has_value() && bias->defined()) y32.add_(bias->to(at::kFloat));
  return f32 ? y32 : y32.to(x.scalar_type());
}

}  // namespace deltaserve_cpu
