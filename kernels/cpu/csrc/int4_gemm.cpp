// y = x W^T for many rows (prefill, big batches) straight from torch's packed int4 weight
// (worker_service/layers/quant_linear.py), no dense copy of W kept: each thread takes panels of
// 32 output columns and, for every chunk of kKChunk values of k, dequantizes the panel's chunk
// once into a small scratch that all rows of x then stream against. The dequantization
// (about K N values) is paid once per call, not once per row: torch's own kernel
// (_weight_int4pack_mm_for_cpu) re-expands W for every 4 rows, 0.4x the dequantized GEMM at
// 300 rows.
//
// torch's pack (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel) stores
// W [N, K] as blocks of `block` output rows (64 on its AVX-512 build, 32 on AVX2 and the
// portable one), each block [K][rows / 2] bytes, two 4-bit codes a byte:
//
//     interleaved, a full block:  byte j of k = row j (low nibble) | row j + block / 2 (high)
//     otherwise (a last block of fewer rows, or torch's portable build):
//                                 byte j of k = row 2 j (low) | row 2 j + 1 (high)
//
// (kernels/cpu/int4_gemm.py finds which one this torch wrote by packing a probe.) Scales and
// zeros are torch's too: sz [K / group, N, 2] bfloat16, w = (q - 8) * sz[g][n][0] + sz[g][n][1].
//
// Bodies: AVX512-BF16 expands the codes to bfloat16 pairs (scratch[k / 2][32 columns][2],
// scale and zero factored out, below) and accumulates with vdpbf16ps, 6 rows x 32 columns per
// register block; every other build dequantizes to float32 (scratch[k][32]) and runs portable
// loops the compiler vectorizes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DELTASERVE_INT4_BF16DOT 1
#include <immintrin.h>
#endif

namespace deltaserve_cpu {
namespace {

constexpr int kPanel = 32;     // output columns per panel
constexpr int kKChunk = 256;   // k values dequantized at a time (a multiple of every group)
constexpr int kRows = 6;       // rows of x per register block: 2 x 6 x 2 accumulators
constexpr int kGroupPanels = 4;  // panels dequantized together (4 x 16 KiB of pairs, in L2)

struct Layout {
  const uint8_t* packed;
  const c10::BFloat16* sz;
  int64_t n, k, group, block;
  bool interleaved;
};

// Where a panel's codes lie: its block's bytes, the bytes per k, and each column's byte and
// shift within a k (columns past the panel's width read as code 8, weight 0).
struct PanelCodes {
  const uint8_t* base;
  int64_t stride;
  int64_t cols;
  int64_t col0;
  int32_t byte[kPanel];
  int32_t shift[kPanel];
};

PanelCodes panel_codes(const Layout& L, int64_t col0) {
  PanelCodes pc{};
  const int64_t b0 = col0 / L.block * L.block;
  const int64_t rows = std::min<int64_t>(L.block, L.n - b0);
  pc.base = L.packed + b0 * L.k / 2;
  pc.stride = rows / 2;
  pc.cols = std::min<int64_t>(kPanel, L.n - col0);
  pc.col0 = col0;
  for (int c = 0; c < pc.cols; ++c) {
    const int64_t r = col0 + c - b0;
    const bool inter = L.interleaved && rows == L.block;
    pc.byte[c] = static_cast<int32_t>(inter ? r % (L.block / 2) : r / 2);
    pc.shift[c] = static_cast<int32_t>(inter ? r / (L.block / 2) : r % 2) * 4;
  }
  return pc;
}

// w[kk][c] for k0 <= k0 + kk < k1, float32, zero past the panel's width.
void dequant_f32(const Layout& L, const PanelCodes& pc, int64_t k0, int64_t k1, float* w) {
  for (int64_t k = k0; k < k1; ++k) {
    const c10::BFloat16* sz = L.sz + ((k / L.group) * L.n + pc.col0) * 2;
    const uint8_t* row = pc.base + k * pc.stride;
    float* out = w + (k - k0) * kPanel;
    for (int c = 0; c < kPanel; ++c) {
      if (c >= pc.cols) {
        out[c] = 0.f;
        continue;
      }
      const int q = (row[pc.byte[c]] >> pc.shift[c]) & 15;
      out[c] = static_cast<float>(q - 8) * static_cast<float>(sz[2 * c]) +
               static_cast<float>(sz[2 * c + 1]);
    }
  }
}

// acc[r][0..32) += sum_k x[r][k] * w[k - k0][..] for r < rows (the portable body).
void rows_f32(const c10::BFloat16* x, int64_t ldx, int64_t rows, const float* w, int64_t k0,
              int64_t k1, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    float* a = acc + r * kPanel;
    for (int64_t k = k0; k < k1; ++k) {
      const float xv = static_cast<float>(x[r * ldx + k]);
      const float* wk = w + (k - k0) * kPanel;
      for (int c = 0; c < kPanel; ++c) a[c] += xv * wk[c];
    }
  }
}

#if defined(DELTASERVE_INT4_BF16DOT)
// The bfloat16 body keeps the codes raw and factors scale and zero out of each group's sum:
//
//     y[r][c] = sum_g  s[g][c] * D[r][g][c] + b[g][c] * X[r][g]
//     D = sum_{k in g} (128 + q[k][c]) x[r][k]     X = sum_{k in g} x[r][k]
//     b = zero - (128 + 8) s                       (w = (q - 8) s + zero)
//
// 128 + q (q < 16) is exact in bfloat16, its bits 0x4300 | q: the codes become dot-product
// operands with an AND and an OR, no float conversion, and s, b apply once per group and row.
constexpr uint16_t kOffsetBits = 0x4300;   // bfloat16(128)
constexpr float kOffset = 128.f + 8.f;

// Per group of the chunk: s[32] then b[32] (float32), zero past the panel's width.
void group_scales(const Layout& L, const PanelCodes& pc, int64_t k0, int64_t k1, float* sb) {
  for (int64_t g0 = k0; g0 < k1; g0 += L.group, sb += 2 * kPanel) {
    const c10::BFloat16* sz = L.sz + ((g0 / L.group) * L.n + pc.col0) * 2;
    for (int c = 0; c < kPanel; ++c) {
      const float sc = c < pc.cols ? static_cast<float>(sz[2 * c]) : 0.f;
      const float z = c < pc.cols ? static_cast<float>(sz[2 * c + 1]) : 0.f;
      sb[c] = sc;
      sb[kPanel + c] = z - kOffset * sc;
    }
  }
}

// pairs[(k - k0) / 2][c] = (128 + q[k][c], 128 + q[k + 1][c]) as bfloat16 bits, any layout.
void raw_pairs(const PanelCodes& pc, int64_t k0, int64_t k1, uint16_t* pairs) {
  for (int64_t k = k0; k < k1; k += 2)
    for (int c = 0; c < kPanel; ++c)
      for (int t = 0; t < 2; ++t) {
        const int q = c < pc.cols ? (pc.base[(k + t) * pc.stride + pc.byte[c]] >> pc.shift[c]) & 15
                                  : 0;
        pairs[(k - k0) * kPanel + 2 * c + t] = static_cast<uint16_t>(kOffsetBits | q);
      }
}

// The same for a whole panel of an interleaved 64-row block, whose 32 columns are the low
// (first half) or high (second half) nibbles of the k's 32 bytes.
void raw_pairs_64(const PanelCodes& pc, int64_t k0, int64_t k1, uint16_t* pairs) {
  const bool high = (pc.col0 % 64) != 0;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i offset = _mm512_set1_epi16(static_cast<int16_t>(kOffsetBits));
  alignas(64) int16_t lo[32], hi[32];        // word 2c <- k's column, 2c + 1 <- k + 1's
  for (int c = 0; c < 16; ++c) {
    lo[2 * c] = static_cast<int16_t>(c), lo[2 * c + 1] = static_cast<int16_t>(32 + c);
    hi[2 * c] = static_cast<int16_t>(16 + c), hi[2 * c + 1] = static_cast<int16_t>(48 + c);
  }
  const __m512i ilo = _mm512_load_si512(lo), ihi = _mm512_load_si512(hi);
  for (int64_t k = k0; k < k1; k += 2) {
    __m512i w[2];
    for (int t = 0; t < 2; ++t) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc.base + (k + t) * 32));
      if (high) v = _mm256_srli_epi16(v, 4);
      w[t] = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(v, low4)), offset);
    }
    uint16_t* out = pairs + (k - k0) * kPanel;
    _mm512_storeu_si512(out, _mm512_permutex2var_epi16(w[0], ilo, w[1]));
    _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(w[0], ihi, w[1]));
  }
}

// acc[r][0..32) += sum over the chunk's groups of s * D + b * X for r < R (vdpbf16ps); xs:
// X of the chunk's first group for row 0, the next group xs_group further.
template <int R>
void rows_dot(const c10::BFloat16* x, int64_t ldx, const uint16_t* pairs, int64_t kk,
              int64_t group, const float* sb, const float* xs, int64_t xs_group, float* acc) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) a[r][v] = _mm512_loadu_ps(acc + r * kPanel + 16 * v);
  for (int64_t g0 = 0; g0 < kk; g0 += group, sb += 2 * kPanel, xs += xs_group) {
    __m512 d[R][2];
    for (int r = 0; r < R; ++r) d[r][0] = d[r][1] = _mm512_setzero_ps();
    for (int64_t p = g0 / 2; p < (g0 + group) / 2; ++p) {
      const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(pairs + p * 64));
      const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(pairs + p * 64 + 32));
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        int32_t xp;
        std::memcpy(&xp, x + r * ldx + 2 * p, sizeof(xp));
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp));
        d[r][0] = _mm512_dpbf16_ps(d[r][0], xb, w0);
        d[r][1] = _mm512_dpbf16_ps(d[r][1], xb, w1);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(xs[r]);
      for (int v = 0; v < 2; ++v) {
        a[r][v] = _mm512_fmadd_ps(d[r][v], _mm512_loadu_ps(sb + 16 * v), a[r][v]);
        a[r][v] = _mm512_fmadd_ps(_mm512_loadu_ps(sb + kPanel + 16 * v), xr, a[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(acc + r * kPanel + 16 * v, a[r][v]);
}

template <int... Rs>
void rows_dot_any(int rows, const c10::BFloat16* x, int64_t ldx, const uint16_t* pairs,
                  int64_t kk, int64_t group, const float* sb, const float* xs, int64_t xs_group,
                  float* acc, std::integer_sequence<int, Rs...>) {
  ((rows == Rs + 1 ? rows_dot<Rs + 1>(x, ldx, pairs, kk, group, sb, xs, xs_group, acc)
                   : void()), ...);
}
#endif

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

template <typename T>
std::unique_ptr<T[], FreeDeleter> aligned(int64_t count) {
  const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
  T* p = static_cast<T*>(std::aligned_alloc(64, std::max<size_t>(bytes, 64)));
  TORCH_CHECK(p != nullptr, "int4pack: cannot allocate ", bytes, " bytes of scratch");
  return std::unique_ptr<T[], FreeDeleter>(p);
}

// x [M, K] as chunks [K / kKChunk][M][kKChunk] (the last one narrower): a register block's
// rows then lie kKChunk values apart instead of K (a row of 4 KiB puts all 12 of them in one
// L1 set, more than its 8 ways).
std::unique_ptr<c10::BFloat16[], FreeDeleter> chunk_rows(const c10::BFloat16* x, int64_t m,
                                                         int64_t k) {
  auto out = aligned<c10::BFloat16>(m * k);
  for (int64_t k0 = 0; k0 < k; k0 += kKChunk) {
    const int64_t width = std::min<int64_t>(kKChunk, k - k0);
    for (int64_t r = 0; r < m; ++r)
      std::memcpy(out.get() + k0 * m + r * width, x + r * k + k0, width * sizeof(*x));
  }
  return out;
}

// X[g][r] = sum of x[r][k] over group g (float32), the zero's factor in the bfloat16 body.
std::unique_ptr<float[], FreeDeleter> group_sums(const c10::BFloat16* x, int64_t m, int64_t k,
                                                 int64_t group) {
  auto out = aligned<float>(m * (k / group));
  for (int64_t g = 0; g < k / group; ++g)
    for (int64_t r = 0; r < m; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < group; ++i) sum += static_cast<float>(x[r * k + g * group + i]);
      out[g * m + r] = sum;
    }
  return out;
}

// y[:, panels p0 .. p1) of x W^T (x chunked as chunk_rows), kGroupPanels panels at a time:
// their chunks dequantized together, so a register block's rows of x, once in L1, serve all of
// them (at 300 rows x streams from L2 once per group instead of once per panel).
void run_panels(const Layout& L, const c10::BFloat16* x, const float* xs, int64_t m,
                c10::BFloat16* y, int64_t p0, int64_t p1) {
  auto acc = aligned<float>(kGroupPanels * m * kPanel);
  auto w = aligned<float>(kKChunk * kPanel);
#if defined(DELTASERVE_INT4_BF16DOT)
  auto pairs = aligned<uint16_t>(kGroupPanels * kKChunk * kPanel);
  const int64_t chunk_groups = kKChunk / L.group;
  auto sb = aligned<float>(kGroupPanels * chunk_groups * 2 * kPanel);
#else
  (void)xs;
#endif
  PanelCodes pcs[kGroupPanels];
  for (int64_t pa = p0; pa < p1; pa += kGroupPanels) {
    const int np = static_cast<int>(std::min<int64_t>(kGroupPanels, p1 - pa));
    for (int j = 0; j < np; ++j) pcs[j] = panel_codes(L, (pa + j) * kPanel);
    std::fill(acc.get(), acc.get() + np * m * kPanel, 0.f);
    for (int64_t k0 = 0; k0 < L.k; k0 += kKChunk) {
      const int64_t k1 = std::min<int64_t>(L.k, k0 + kKChunk);
      const c10::BFloat16* xc = x + k0 * m;
      for (int j = 0; j < np; ++j) {
        const PanelCodes& pc = pcs[j];
#if defined(DELTASERVE_INT4_BF16DOT)
        uint16_t* pj = pairs.get() + j * kKChunk * kPanel;
        if (L.interleaved && L.block == 64 && pc.cols == kPanel && pc.stride == 32)
          raw_pairs_64(pc, k0, k1, pj);
        else
          raw_pairs(pc, k0, k1, pj);
        group_scales(L, pc, k0, k1, sb.get() + j * chunk_groups * 2 * kPanel);
#else
        dequant_f32(L, pc, k0, k1, w.get());
        rows_f32(xc, k1 - k0, m, w.get(), 0, k1 - k0, acc.get() + j * m * kPanel);
#endif
      }
#if defined(DELTASERVE_INT4_BF16DOT)
      for (int64_t r0 = 0; r0 < m; r0 += kRows)
        for (int j = 0; j < np; ++j)
          rows_dot_any(static_cast<int>(std::min<int64_t>(kRows, m - r0)),
                       xc + r0 * (k1 - k0), k1 - k0, pairs.get() + j * kKChunk * kPanel,
                       k1 - k0, L.group, sb.get() + j * chunk_groups * 2 * kPanel,
                       xs + (k0 / L.group) * m + r0, m, acc.get() + (j * m + r0) * kPanel,
                       std::make_integer_sequence<int, kRows>{});
#endif
    }
    for (int j = 0; j < np; ++j)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < pcs[j].cols; ++c)
          y[r * L.n + pcs[j].col0 + c] = acc[(j * m + r) * kPanel + c];
  }
}

Layout layout_of(const at::Tensor& packed, const at::Tensor& sz, int64_t group, int64_t n,
                 int64_t block, bool interleaved) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) == n,
              "int4pack: packed must be contiguous uint8 [n=", n, ", K / 2], got ",
              packed.sizes());
  const int64_t k = packed.size(1) * 2;
  TORCH_CHECK(n % 16 == 0 && n > 0, "int4pack: n=", n, " must be a positive multiple of 16");
  TORCH_CHECK(group == 32 || group == 64 || group == 128 || group == 256,
              "int4pack: group=", group, " must be 32, 64, 128 or 256");
  TORCH_CHECK(k % group == 0, "int4pack: K=", k, " must be a multiple of group=", group);
  TORCH_CHECK(block == 32 || block == 64, "int4pack: block=", block, " must be 32 or 64");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 &&
                  sz.size(0) == k / group && sz.size(1) == n && sz.size(2) == 2,
              "int4pack: scales_and_zeros must be contiguous bfloat16 [", k / group, ", ", n,
              ", 2], got ", sz.scalar_type(), " ", sz.sizes());
  return Layout{packed.data_ptr<uint8_t>(), sz.data_ptr<c10::BFloat16>(), n, k, group, block,
                interleaved};
}

}  // namespace

// y [M, N] bfloat16 = x [M, K] bfloat16 @ W^T, W torch's packed int4 (the layout above).
at::Tensor int4pack_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                           int64_t group, int64_t n, int64_t block, bool interleaved) {
  const Layout L = layout_of(packed, sz, group, n, block, interleaved);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == L.k,
              "int4pack_linear: x must be contiguous bfloat16 [M, K=", L.k, "], got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto chunked = chunk_rows(x.data_ptr<c10::BFloat16>(), m, L.k);
#if defined(DELTASERVE_INT4_BF16DOT)
  const auto sums = group_sums(x.data_ptr<c10::BFloat16>(), m, L.k, L.group);
  const float* xs = sums.get();
#else
  const float* xs = nullptr;
#endif
  const c10::BFloat16* xp = chunked.get();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    run_panels(L, xp, xs, m, yp, p0, p1);
  });
  return y;
}

// W [N, K] float32 as int4pack_linear reads it (the layout probe and the tests).
at::Tensor int4pack_dequantize(const at::Tensor& packed, const at::Tensor& sz, int64_t group,
                               int64_t n, int64_t block, bool interleaved) {
  const Layout L = layout_of(packed, sz, group, n, block, interleaved);
  at::Tensor w = at::empty({n, L.k}, packed.options().dtype(at::kFloat));
  auto* out = w.data_ptr<float>();
  auto chunk = aligned<float>(L.k * kPanel);
  for (int64_t col0 = 0; col0 < n; col0 += kPanel) {
    const PanelCodes pc = panel_codes(L, col0);
    dequant_f32(L, pc, 0, L.k, chunk.get());
    for (int64_t c = 0; c < pc.cols; ++c)
      for (int64_t k = 0; k < L.k; ++k) out[(col0 + c) * L.k + k] = chunk[k * kPanel + c];
  }
  return w;
}

}  // namespace deltaserve_cpu
