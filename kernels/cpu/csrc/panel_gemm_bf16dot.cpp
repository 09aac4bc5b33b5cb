// y = x W^T + b for many rows of bfloat16 (a long prefill's experts, kernels/cpu/moe_experts.py)
// straight from panel_gemm.cpp's panels, on a CPU with AVX512-BF16 dot products:
//
//     panels[p][k][0..31] = W[32 p + 0..31][k]   (bfloat16, zero rows past N)
//
// Rows k and k + 1 of a panel (32 bf16 each) are interleaved in registers into the (k, k + 1)
// pairs `vdpbf16ps` takes (unpacklo/hi of 16-bit words: per 128-bit lane, columns 0-3 in `lo`,
// 4-7 in `hi`), x's pair (x[r][k], x[r][k + 1]) is one 32-bit broadcast from a copy of the row
// block's pairs (pack_pairs, once per slice of rows), and 12 rows x 32 columns accumulate in 24
// registers over the whole of k; the two halves are put back in column order once, at the
// store. A slice of x's rows (~384 KiB) and a panel (k x 64 bytes) stay in L2 while the slice's
// row blocks walk the thread's panels.
// bf16 products are exact in float32, so this is F.linear's bf16 GEMM (float32 accumulation,
// bias added in float32, one rounding to bf16 at the end) up to the order of the sums. Without
// AVX512-BF16 (or for an odd k) panel_linear_many is panel_linear.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "simd.h"

namespace deltaserve_cpu {

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias);

namespace {

#if defined(DELTASERVE_SIMD) && DELTASERVE_SIMD == 512 && defined(__AVX512BF16__)
#define DELTASERVE_PANEL_BF16DOT 1
constexpr int kPanel = 32;
constexpr int kRows = 12;     // rows per register block: 24 accumulators

inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// 16 float32 -> 16 bfloat16 (round to nearest even, as c10 rounds) at y, the first `cols`.
inline void store_bf16(c10::BFloat16* y, __m512 v, int cols) {
  if (cols <= 0) return;
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  const __mmask16 m = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  _mm256_mask_storeu_epi16(y, m, h);
}

// y[r][0..cols) = bf16(bias + sum_k x[r][k] * panel[k][..]) for r < R; k even; xp the row
// block's pairs, xp[i * kRows + r] = (x[r][2i], x[r][2i + 1]) (pack_pairs).
template <int R>
void block(const uint32_t* xp, const c10::BFloat16* panel, int64_t k, const float* bias,
           c10::BFloat16* y, int64_t ldy, int cols) {
  __m512 lo[R], hi[R];   // lo: columns {0-3, 8-11, 16-19, 24-27}; hi: the other 16
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += 2) {
    const __m512i a = _mm512_loadu_si512(panel + kk * kPanel);
    const __m512i b = _mm512_loadu_si512(panel + (kk + 1) * kPanel);
    const __m512i wl = _mm512_unpacklo_epi16(a, b), wh = _mm512_unpackhi_epi16(a, b);
    const uint32_t* pairs = xp + (kk / 2) * kRows;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i x2 = _mm512_set1_epi32(static_cast<int>(pairs[r]));
      lo[r] = dot2(lo[r], x2, wl);
      hi[r] = dot2(hi[r], x2, wh);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : __mmask16((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1);
    b0 = _mm512_maskz_loadu_ps(m0, bias);
    b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
  }
  for (int r = 0; r < R; ++r) {
    store_bf16(y + r * ldy, _mm512_add_ps(b0, _mm512_permutex2var_ps(lo[r], first, hi[r])), cols);
    store_bf16(y + r * ldy + 16, _mm512_add_ps(b1, _mm512_permutex2var_ps(lo[r], second, hi[r])),
               cols - 16);
  }
}

using BlockFn = void (*)(const uint32_t*, const c10::BFloat16*, int64_t, const float*,
                         c10::BFloat16*, int64_t, int);

template <size_t... R>
constexpr auto block_table(std::index_sequence<R...>) {
  return std::array<BlockFn, sizeof...(R)>{block<static_cast<int>(R) + 1>...};
}

// Rows r0 .. r1 of x [.., k] as pairs, row block by row block: out[(b * k / 2 + i) * kRows + r]
// = (x[r0 + 12 b + r][2i], [2i + 1]); a block's pairs of one k step are then 48 contiguous
// bytes, where x's rows (k * 2 bytes apart: 4 KiB at k = 2048) would alias in L1.
void pack_pairs(const c10::BFloat16* x, int64_t k, int64_t r0, int64_t r1, uint32_t* out) {
  const int64_t half = k / 2;
  for (int64_t b0 = r0; b0 < r1; b0 += kRows) {
    uint32_t* dst = out + ((b0 - r0) / kRows) * half * kRows;
    const int64_t rows = std::min<int64_t>(kRows, r1 - b0);
    for (int64_t r = 0; r < rows; ++r) {
      const c10::BFloat16* src = x + (b0 + r) * k;
      for (int64_t i = 0; i < half; ++i) std::memcpy(dst + i * kRows + r, src + 2 * i, 4);
    }
  }
}

// y [m, n] = x [m, k] W^T (+ bias [n] float32), every panel split between the threads.
void gemm(const c10::BFloat16* x, int64_t m, int64_t k, const c10::BFloat16* panels, int64_t n,
          const float* bias, c10::BFloat16* y) {
  static constexpr auto fns = block_table(std::make_index_sequence<kRows>{});
  const int64_t np = (n + kPanel - 1) / kPanel;
  // rows in slices of ~384 KiB of x, packed as pairs once a slice, each slice walking the
  // thread's panels: the slice and a panel (k x 64 bytes) stay in L2
  // (k = 0 counted as 1: no division by zero; every row is then the bias)
  const int64_t slice =
      std::max<int64_t>(4 * kRows, (393216 / (2 * std::max<int64_t>(1, k))) / kRows * kRows);
  at::parallel_for(0, np, 1, [&](int64_t lo, int64_t hi) {
    const int64_t rows = std::min(m, slice);
    std::vector<uint32_t> pairs(static_cast<size_t>((rows + kRows - 1) / kRows * kRows * k / 2));
    for (int64_t s0 = 0; s0 < m; s0 += slice) {
      const int64_t s1 = std::min(m, s0 + slice);
      pack_pairs(x, k, s0, s1, pairs.data());
      for (int64_t p = lo; p < hi; ++p) {
        const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - p * kPanel));
        for (int64_t r0 = s0; r0 < s1; r0 += kRows) {
          const int rows_here = static_cast<int>(std::min<int64_t>(kRows, s1 - r0));
          fns[rows_here - 1](pairs.data() + ((r0 - s0) / kRows) * (k / 2) * kRows,
                             panels + p * k * kPanel, k, bias ? bias + p * kPanel : nullptr,
                             y + r0 * n + p * kPanel, n, cols);
        }
      }
    }
  });
}
#endif

}  // namespace

// Whether panel_linear_many takes bfloat16 in AVX512-BF16 pairs (this build, this CPU).
bool panel_bf16_dot() {
#if defined(DELTASERVE_PANEL_BF16DOT)
  return true;
#else
  return false;
#endif
}

// panel_linear for many rows: x [M, K] in the panels' dtype -> [M, n] in that dtype; bfloat16
// (even K) in dot-product pairs where the build has them, everything else as panel_linear.
at::Tensor panel_linear_many(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                             const std::optional<at::Tensor>& bias) {
#if defined(DELTASERVE_PANEL_BF16DOT)
  if (x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() &&
      x.size(1) % 2 == 0 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous()) {
    TORCH_CHECK(panels.dim() == 3 && panels.size(1) == x.size(1) && panels.size(2) == kPanel &&
                    n > 0 && panels.size(0) == (n + kPanel - 1) / kPanel,
                "panels ", panels.sizes(), " do not match x ", x.sizes(), " and n=", n);
    at::Tensor b32;
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [", n, "], got ",
                  bias->sizes());
      b32 = bias->to(at::kFloat).contiguous();
    }
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    if (x.size(0) > 0)
      gemm(x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), panels.data_ptr<c10::BFloat16>(),
           n, b32.defined() ? b32.data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>());
    return y;
  }
#endif
  return panel_linear(x, panels, n, bias);
}

}  // namespace deltaserve_cpu
