// The greedy token of x W^T for a wide float32 weight (an LM head) without the float32 GEMM:
// every logit is first estimated in 16-bit integers, at twice the multiply-adds per instruction
// of float32 (AVX2 vpmaddwd, AVX-512 vpdpwssd), with a proven bound on the estimate's error; only
// the few columns whose bound reaches the best lower bound are then computed in float32, and
// the largest of those is the argmax of the float32 logits over the whole vocabulary.
//
// Why the answer is exact. Let C_v be the float32 dot product of x and row v of W, computed in
// one fixed order (float_dot below), and A_v the integer estimate, with |C_v - A_v| <= E_v:
//
//     x ~ sx qx, qx integers in [-2047, 2047]     (per row of x, at each call)
//     w_v ~ sw_v qw_v, qw_v in [-Qw, Qw]          (per row of W, at pack time; Qw keeps
//                                                  K 2047 Qw below 2^31, so int32 never wraps)
//     A_v = float(qx . qw_v) * sw_v  (in units of sx: the comparisons below scale alike)
//     E_v = |x - x^| |w_v| + |x^| |w_v - w^_v|    (Cauchy-Schwarz on the two quantisations)
//         + 2.01u |x^| (|w_v| + |w_v - w^_v|)     (the int -> float conversion and one product)
//         + gamma_K |x| |w_v|                     (C_v's own rounding: any order of K FMAs)
//         + (K + 8)(1 + gamma_K) 2^-150           (C_v's underflow: each of its <= K + 7 FMAs
//                                                  errs by up to 2^-150 absolute where its
//                                                  result is subnormal, then rounds onwards)
//
// with u = 2^-24, gamma_K = K u / (1 - K u), norms Euclidean and taken at their per-block maxima
// (kCols columns) and every coefficient rounded up to float, plus a slack for the float
// arithmetic of the estimates and comparisons: 8 u |x^| (max|w| + max|w - w^|) for its
// relative rounding and 2^-148 (in units of sx) for its own underflows. Everything is computed
// in units of sx, so a row whose estimates there could pass 1e37 (|x^| / sx (max|w| +
// max|w - w^|), which grows as x shrinks) is handed back: an estimate rounded to inf would
// otherwise set a best that no finite bound can reach. If A_v + E_v is below max_u (A_u - E_u)
// then C_v < C_u, so v is not the argmax of C; every column that survives is computed as C_v,
// and the first of the largest wins, as torch.argmax's does.
// So the result is the argmax of the float32 logits C, the same on any batch (C_v depends on
// x's row alone): what the float32 GEMM path returns up to its own summation order, which
// differs from this one's only where two logits tie within float32 rounding. The pack and the
// screen run in IEEE mode whatever the caller's (IeeeMode: no flush-to-zero, no
// denormals-are-zero, round to nearest), which all of the above assumes.
//
// A row with a non-finite value, all zeros, a largest value too small for its scale (below
// about 6e-36), logits or scaled estimates near float32's range, or more surviving columns than
// kMaxCandidates comes back as -1, for the caller's float32 path.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "float_bounds.h"
#include "simd.h"

namespace deltaserve_cpu {

#if DELTASERVE_SIMD == 256
namespace {

constexpr int kCols = 16;        // output columns per packed block: two ymm of int32
constexpr int kRowBlock = 4;     // rows of x per register block (8 accumulators); fewer at the end
constexpr int32_t kQx = 2047;
constexpr double kUnit = 1.0 / 16777216.0;       // float32's unit roundoff, 2^-24
constexpr double kSafety = 1.0 + 1e-5;            // covers double rounding of the bounds
constexpr size_t kMaxCandidates = 4096;           // per row and thread, before the fallback
constexpr int64_t kBlocksPerTask = 8;
constexpr double kTooLarge = 1e30;                // |x| |w_v| past this: float32 path
// |x^| / sx (max|w| + max|w - w^|) past this: float32 path. It bounds the estimates (units of
// sx), their bounds (1.1 times) and the comparisons' sums (3.2 times) well below 3.4e38.
constexpr double kScaledTooLarge = 1e37;
constexpr double kUnderflow = 7.006492321624085e-46;  // 2^-150: a subnormal result's worst error

// Qw for rows of K values: the largest with K * kQx * Qw < 2^31, at most kQx.
int32_t weight_levels(int64_t kp) {
  return static_cast<int32_t>(std::min<int64_t>(kQx, ((int64_t{1} << 31) - 1) / (kp * kQx)));
}

typedef int32_t v8si __attribute__((vector_size(32)));

// out[r][c] = sum_k xq[r][k] * block[k][c] for r < R <= 4, c < 16 (int32, exact): one vpmaddwd
// and one vpaddd per 16 multiply-adds. The sums use GCC's vector `+=`, which GCC keeps in
// registers (_mm256_add_epi32 over an array of __m256i cost a register copy per add).
template <int R>
inline void int_block(const int16_t* xq, int64_t ldx, const int16_t* block, int64_t kp,
                      int32_t (*out)[kCols]) {
  v8si a[R][2] = {};
  for (int64_t k2 = 0; k2 < kp / 2; ++k2) {
    const int16_t* w = block + k2 * 2 * kCols;
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t pair;             // (x[2 k2], x[2 k2 + 1]) of row r, broadcast
      std::memcpy(&pair, xq + r * ldx + 2 * k2, sizeof pair);
      const __m256i b = _mm256_set1_epi32(pair);
      a[r][0] += (v8si)_mm256_madd_epi16(b, w0);
      a[r][1] += (v8si)_mm256_madd_epi16(b, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    std::memcpy(out[r], &a[r][0], sizeof a[r][0]);
    std::memcpy(out[r] + 8, &a[r][1], sizeof a[r][1]);
  }
}

void int_rows(int rows, const int16_t* xq, int64_t ldx, const int16_t* block, int64_t kp,
              int32_t (*out)[kCols]) {
  switch (rows) {
    case 1: return int_block<1>(xq, ldx, block, kp, out);
    case 2: return int_block<2>(xq, ldx, block, kp, out);
    case 3: return int_block<3>(xq, ldx, block, kp, out);
    default: return int_block<4>(xq, ldx, block, kp, out);
  }
}

// x . w in float32, one fixed order (lane-wise FMAs, then the lanes' sum).
inline float float_dot(const float* x, const float* w, int64_t k) {
  using namespace simd;
  vf acc = zero();
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) acc = fmadd(loadu(x + i), loadu(w + i), acc);
  if (i < k) acc = fmadd(loadu_first(x + i, k - i, zero()), loadu_first(w + i, k - i, zero()), acc);
  return reduce_add(acc);
}

// One row of x, quantised, and the bound's coefficients in units of its scale sx:
// E'_block = alpha * max|w_v| + beta * max|w_v - w^_v| + eta.
struct RowScreen {
  bool ok = false;
  float alpha = 0, beta = 0, eta = 0;
};

RowScreen quantise_row(const float* x, int64_t k, int64_t kp, int16_t* q, double max_norm,
                       double max_err) {
  RowScreen s;
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < k; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  std::fill(q, q + kp, int16_t{0});
  if (!finite || amax == 0.0f) return s;
  const float sx = amax / static_cast<float>(kQx);
  const float inv = static_cast<float>(kQx) / amax;
  if (sx == 0.0f || !std::isfinite(inv)) return s;     // amax near the subnormals' floor
  double xx = 0, ee = 0, hh = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int32_t v = std::clamp(static_cast<int32_t>(std::nearbyint(x[i] * inv)), -kQx, kQx);
    q[i] = static_cast<int16_t>(v);
    const double hat = static_cast<double>(sx) * v, d = static_cast<double>(x[i]) - hat;
    xx += static_cast<double>(x[i]) * x[i];
    ee += d * d;
    hh += hat * hat;
  }
  const double xn = std::sqrt(xx), en = std::sqrt(ee), hn = std::sqrt(hh);
  if (xn * max_norm > kTooLarge || hn / sx * (max_norm + max_err) > kScaledTooLarge) return s;
  const double gamma = k * kUnit / (1.0 - k * kUnit);
  s.alpha = up((en + 2.01 * kUnit * hn + gamma * xn) * kSafety / sx);
  s.beta = up(hn * (1.0 + 2.01 * kUnit) * kSafety / sx);
  const double underflow = (k + 8) * (1.0 + gamma) * kUnderflow;     // C_v's, in real units
  s.eta = up((8.0 * kUnit * hn * (max_norm + max_err) + underflow) * kSafety / sx +
             4 * kUnderflow);               // the estimates' and bounds' own, in units of sx
  s.ok = true;
  return s;
}

struct Candidate {
  int32_t col;
  float upper;      // A' + E': no C of this column is above it (in units of sx)
};

// One thread's screen: the best lower bound so far per row and the columns that may beat it.
struct Screen {
  std::vector<float> best;
  std::vector<std::vector<Candidate>> cands;
  std::vector<uint8_t> overflow;
  explicit Screen(int64_t m)
      : best(m, -std::numeric_limits<float>::infinity()), cands(m), overflow(m, 0) {}

  // Row r's estimates a[0..kCols) of block columns col0.. with bound e.
  void take(int64_t r, const float* a, int64_t col0, float e) {
    float& b = best[r];
    for (int c = 0; c < kCols; ++c) {
      if (a[c] < b - e) continue;
      b = std::max(b, a[c] - e);
      if (cands[r].size() >= kMaxCandidates) {
        overflow[r] = 1;
        continue;
      }
      cands[r].push_back({static_cast<int32_t>(col0 + c), a[c] + e});
    }
  }
};

// Estimates of block `blk` for rows r0 .. r0 + rows, fed to the thread's screen.
void screen_block(const int16_t* xq, int64_t kp, const int16_t* packed, const float* scale,
                  const float* floor, const float* bounds, const RowScreen* rows_info,
                  int64_t blk, int64_t r0, int rows, Screen& screen) {
  alignas(64) int32_t acc[kRowBlock][kCols];
  int_rows(rows, xq + r0 * kp, kp, packed + blk * kp * kCols, kp, acc);
  const float* sw = scale + blk * kCols;
  const float* lo = floor + blk * kCols;
  const float max_norm = bounds[2 * blk], max_err = bounds[2 * blk + 1];
  alignas(64) float a[kCols];
  for (int r = 0; r < rows; ++r) {
    const RowScreen& s = rows_info[r0 + r];
    if (!s.ok) continue;
    const float e = s.alpha * max_norm + s.beta * max_err + s.eta;
    const float thr = screen.best[r0 + r] - e;
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int c = 0; c < kCols; ++c) {
      a[c] = static_cast<float>(acc[r][c]) * sw[c] + lo[c];
      top = std::max(top, a[c]);
    }
    if (top >= thr) screen.take(r0 + r, a, blk * kCols, e);
  }
}

}  // namespace

bool screen_available() { return true; }

// weight [N, K] float32 -> (packed int16 [blocks, K', kCols] pairs, scale [blocks * kCols],
// floor [blocks * kCols]: 0, or -inf for the padding columns, bounds [blocks, 2]: the largest
// |w_v| and |w_v - w^_v| of each block, rounded up). K' is K rounded up to even.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> screen_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be a contiguous float32 [N, K] tensor");
  const int64_t n = weight.size(0), k = weight.size(1), kp = (k + 1) / 2 * 2;
  const int64_t blocks = (n + kCols - 1) / kCols;
  const int32_t qw = weight_levels(kp);
  TORCH_CHECK(k > 0 && qw >= 15, "screen_pack: K = ", k, " is too large for 16-bit screening");
  at::Tensor packed = at::zeros({blocks, kp, kCols}, weight.options().dtype(at::kShort));
  at::Tensor scale = at::zeros({blocks * kCols}, weight.options());
  at::Tensor floor = at::full({blocks * kCols}, -std::numeric_limits<float>::infinity(),
                              weight.options());
  at::Tensor bounds = at::zeros({blocks, 2}, weight.options());
  const float* w = weight.data_ptr<float>();
  int16_t* pk = packed.data_ptr<int16_t>();
  float* sc = scale.data_ptr<float>();
  float* fl = floor.data_ptr<float>();
  float* bd = bounds.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const IeeeMode ieee;
    for (int64_t b = b0; b < b1; ++b) {
      double max_norm = 0, max_err = 0;
      for (int c = 0; c < kCols && b * kCols + c < n; ++c) {
        const int64_t v = b * kCols + c;
        const float* row = w + v * k;
        float amax = 0.0f;
        for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
        TORCH_CHECK(std::isfinite(amax), "screen_pack: weight row ", v, " is not finite");
        // a row too small for qw / amax in float32 gets w^ = 0 (its whole norm is the error)
        const bool levels = amax != 0.0f && std::isfinite(static_cast<float>(qw) / amax);
        const float sw = levels ? amax / static_cast<float>(qw) : 0.0f;
        const float inv = levels ? static_cast<float>(qw) / amax : 0.0f;
        double nn = 0, ee = 0;
        for (int64_t i = 0; i < k; ++i) {
          const int32_t q = std::clamp(static_cast<int32_t>(std::nearbyint(row[i] * inv)), -qw, qw);
          // pairs of k: element (k, c) at [k / 2][c][k % 2] within the block
          pk[(b * kp + i / 2 * 2) * kCols + 2 * c + i % 2] = static_cast<int16_t>(q);
          const double d = static_cast<double>(row[i]) - static_cast<double>(sw) * q;
          nn += static_cast<double>(row[i]) * row[i];
          ee += d * d;
        }
        sc[v] = sw;
        fl[v] = 0.0f;
        max_norm = std::max(max_norm, std::sqrt(nn));
        max_err = std::max(max_err, std::sqrt(ee));
      }
      bd[2 * b] = up(max_norm * kSafety);
      bd[2 * b + 1] = up(max_err * kSafety);
    }
  });
  return {packed, scale, floor, bounds};
}

// x [M, K] float32, weight [N, K] (the packed one's source), screen_pack's tensors -> the argmax
// of x W^T per row (first on ties), or -1 for a row the caller must take through float32.
at::Tensor screen_greedy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                         const at::Tensor& scale, const at::Tensor& floor,
                         const at::Tensor& bounds) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  // exactly screen_pack's shapes (a longer pack's columns past N would raise the best bound)
  const int64_t nb = (weight.size(0) + kCols - 1) / kCols;
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1) &&
                  packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kCols &&
                  packed.size(0) == nb && packed.size(1) == (x.size(1) + 1) / 2 * 2 &&
                  scale.is_contiguous() && scale.numel() == nb * kCols &&
                  floor.is_contiguous() && floor.numel() == nb * kCols &&
                  bounds.is_contiguous() && bounds.numel() == nb * 2,
              "screen_greedy: packed weight does not match x [M, K] and weight [N, K]");
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1), n = weight.size(0);
  const int64_t blocks = packed.size(0);
  at::Tensor ids = at::full({m}, -1, x.options().dtype(at::kLong));
  if (m == 0) return ids;
  const IeeeMode ieee;             // this thread's quantisation (the workers set their own)
  const float* bd = bounds.data_ptr<float>();
  double max_norm = 0, max_err = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    max_norm = std::max<double>(max_norm, bd[2 * b]);
    max_err = std::max<double>(max_err, bd[2 * b + 1]);
  }
  at::Tensor xq = at::empty({m, kp}, x.options().dtype(at::kShort));
  std::vector<RowScreen> rows(static_cast<size_t>(m));
  const float* xp = x.data_ptr<float>();
  int16_t* xqp = xq.data_ptr<int16_t>();
  for (int64_t r = 0; r < m; ++r)
    rows[r] = quantise_row(xp + r * k, k, kp, xqp + r * kp, max_norm, max_err);

  const int64_t tasks = (blocks + kBlocksPerTask - 1) / kBlocksPerTask;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                          tasks)));
  std::vector<Screen> screens;
  screens.reserve(nt);
  for (int t = 0; t < nt; ++t) screens.emplace_back(m);
  const int16_t* pk = packed.data_ptr<int16_t>();
  const float* sc = scale.data_ptr<float>();
  const float* fl = floor.data_ptr<float>();
#pragma omp parallel num_threads(nt)
  {
    const IeeeMode ieee;
    Screen& mine = screens[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t)
      for (int64_t blk = t * kBlocksPerTask; blk < std::min(blocks, (t + 1) * kBlocksPerTask);
           ++blk)
        for (int64_t r0 = 0; r0 < m; r0 += kRowBlock)
          screen_block(xqp, kp, pk, sc, fl, bd, rows.data(), blk, r0,
                       static_cast<int>(std::min<int64_t>(kRowBlock, m - r0)), mine);
  }

  const float* w = weight.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, m, 16, [&](int64_t lo, int64_t hi) {
    const IeeeMode ieee;
    for (int64_t r = lo; r < hi; ++r) {
      if (!rows[r].ok) continue;
      float best = -std::numeric_limits<float>::infinity();
      bool overflow = false;
      for (const Screen& s : screens) {
        best = std::max(best, s.best[r]);
        overflow = overflow || s.overflow[r];
      }
      if (overflow) continue;
      int64_t arg = -1;
      float top = -std::numeric_limits<float>::infinity();
      for (const Screen& s : screens)
        for (const Candidate& c : s.cands[r]) {
          if (c.upper < best || c.col >= n) continue;
          const float v = float_dot(xp + r * k, w + static_cast<int64_t>(c.col) * k, k);
          if (arg < 0 || v > top || (v == top && c.col < arg)) {
            top = v;
            arg = c.col;
          }
        }
      ip[r] = std::isfinite(top) ? arg : -1;
    }
  });
  return ids;
}

#else   // AVX-512 (its float32 FMAs match 16-bit multiply-adds per cycle) or generic: MKL's path

bool screen_available() { return false; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> screen_pack(const at::Tensor&) {
  TORCH_CHECK(false, "screen_pack: only the AVX2 build screens (screen_available() is false)");
}

at::Tensor screen_greedy(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "screen_greedy: only the AVX2 build screens (screen_available() is false)");
}

#endif
}  // namespace deltaserve_cpu
