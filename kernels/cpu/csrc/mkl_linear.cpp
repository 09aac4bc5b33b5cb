// Linear layers through the MKL that libtorch_cpu carries (found with dlsym at first use, so a
// torch built without it just reports unavailable):
//
//   float32:  y = x W^T + b with W packed once by cblas_sgemm_pack (MKL's own blocked layout)
//             and cblas_sgemm_compute for any number of rows. PyTorch's own packed path
//             (torch.ops.mkl._mkl_linear) only uses the pack when the rows equal the pack's
//             batch size, and falls back to an unpacked GEMM otherwise.
//   tiled:    a wide weight (an LM head: tens of thousands of rows) packed as column tiles of
//             y, each tile's [M, tile] output small enough to stay in L2 while it is written;
//             and the same tiles feeding a streaming argmax (row_argmax.h), so a greedy step
//             never writes its [M, vocab] logits to memory at all.
//   bfloat16: cblas_gemm_bf16bf16f32 (float32 accumulation, rounded to bfloat16 once, as
//             F.linear does), which on CPUs without native bf16 dot products is several times
//             faster than oneDNN's path that F.linear takes.
//
// A packed weight must never be moved or copied: MKL keeps metadata that depends on the
// buffer's address (a uint8 tensor that only this module reads).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "row_argmax.h"

namespace deltaserve_cpu {
namespace {

// CBLAS constants (mkl_cblas.h / cblas.h).
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kBMatrix = 162;

using PackGetSize = size_t (*)(int, int, int, int);
using Pack = void (*)(int, int, int, int, int, int, float, const float*, int, float*);
using Compute = void (*)(int, int, int, int, int, int, const float*, int, const float*, int, float,
                         float*, int);
using GemmBf16 = void (*)(int, int, int, int, int, int, float, const uint16_t*, int,
                          const uint16_t*, int, float, float*, int);

struct Mkl {
  PackGetSize pack_get_size = nullptr;
  Pack pack = nullptr;
  Compute compute = nullptr;
  GemmBf16 gemm_bf16 = nullptr;
  bool sgemm_packed() const { return pack_get_size && pack && compute; }
};

const Mkl& mkl() {
  static const Mkl found = [] {
    Mkl m;
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* scope = lib ? lib : RTLD_DEFAULT;
    m.pack_get_size = reinterpret_cast<PackGetSize>(dlsym(scope, "cblas_sgemm_pack_get_size"));
    m.pack = reinterpret_cast<Pack>(dlsym(scope, "cblas_sgemm_pack"));
    m.compute = reinterpret_cast<Compute>(dlsym(scope, "cblas_sgemm_compute"));
    m.gemm_bf16 = reinterpret_cast<GemmBf16>(dlsym(scope, "cblas_gemm_bf16bf16f32"));
    return m;
  }();
  return found;
}

void add_bias_rows(float* y, const float* b, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i) {
    float* row = y + i * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] += b[j];
  }
}

}  // namespace

bool mkl_sgemm_packed_available() { return mkl().sgemm_packed(); }
bool mkl_bf16_available() { return mkl().gemm_bf16 != nullptr; }

// weight [N, K] float32 -> the packed B operand of y = x W^T (uint8 bytes).
at::Tensor mkl_pack(const at::Tensor& weight) {
  TORCH_CHECK(mkl().sgemm_packed(), "MKL packed sgemm is not available in this torch build");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "weight must be a contiguous float32 [N, K] tensor");
  const int n = static_cast<int>(weight.size(0)), k = static_cast<int>(weight.size(1));
  const size_t bytes = mkl().pack_get_size(kBMatrix, 1, n, k);
  at::Tensor packed = at::empty({static_cast<int64_t>(bytes) + 64}, weight.options().dtype(at::kByte));
  mkl().pack(kRowMajor, kBMatrix, kTrans, 1, n, k, 1.0f, weight.data_ptr<float>(), k,
             reinterpret_cast<float*>(packed.data_ptr<uint8_t>()));
  return packed;
}

// x [M, K] float32 contiguous, packed from mkl_pack of a [n, K] weight -> [M, n].
at::Tensor mkl_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  mkl().compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n),
                static_cast<int>(k), x.data_ptr<float>(), static_cast<int>(k),
                reinterpret_cast<const float*>(packed.data_ptr<uint8_t>()), static_cast<int>(k),
                0.0f, y.data_ptr<float>(), static_cast<int>(n));
  if (bias.has_value() && bias->defined()) {
    at::Tensor b = bias->contiguous();
    add_bias_rows(y.data_ptr<float>(), b.data_ptr<float>(), m, n);
  }
  return y;
}

namespace {

// y[:, t*tile : ...] = x W_t^T for the tiles t this thread owns (static split; MKL runs single
// threaded inside the parallel region).
void tiled_compute(const float* x, int64_t m, int64_t k, const std::vector<at::Tensor>& tiles,
                   int64_t tile_n, int64_t n, int64_t t, float* y, int64_t ldy) {
  const int64_t cols = std::min(tile_n, n - t * tile_n);
  mkl().compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(cols),
                static_cast<int>(k), x, static_cast<int>(k),
                reinterpret_cast<const float*>(tiles[t].data_ptr<uint8_t>()),
                static_cast<int>(k), 0.0f, y, static_cast<int>(ldy));
}

void check_tiled(const at::Tensor& x, const std::vector<at::Tensor>& tiles, int64_t tile_n,
                 int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(tile_n > 0 && static_cast<int64_t>(tiles.size()) == (n + tile_n - 1) / tile_n,
              "tiles must cover n columns in tiles of tile_n");
}

int threads_for(int64_t num_tiles) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                  num_tiles)));
}

}  // namespace

// x [M, K] float32 times a weight packed as column tiles -> [M, n] (+ bias).
at::Tensor mkl_tiled_linear(const at::Tensor& x, const std::vector<at::Tensor>& tiles,
                            int64_t tile_n, int64_t n, const std::optional<at::Tensor>& bias) {
  check_tiled(x, tiles, tile_n, n);
  const int64_t m = x.size(0), k = x.size(1), num_tiles = static_cast<int64_t>(tiles.size());
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel for schedule(static) num_threads(threads_for(num_tiles))
  for (int64_t t = 0; t < num_tiles; ++t)
    tiled_compute(xp, m, k, tiles, tile_n, n, t, yp + t * tile_n, n);
  if (bias.has_value() && bias->defined()) {
    at::Tensor b = bias->contiguous();
    add_bias_rows(yp, b.data_ptr<float>(), m, n);
  }
  return y;
}

// Rows per GEMM call of the greedy LM head on one thread: the tile's weight comes from L3 once
// and is reused from L2 by the next block, and a 128 x 512 output block stays in L2 beside it
// (256 rows: 42.9 -> 38.7 ms at K = 256, 92.2 -> 83.4 ms at K = 576). With two threads the
// blocks measured 2-5% slower than whole tiles, so a team of more than one takes whole tiles.
// AVX2 (MKL's AVX2 sgemm, emulated on the Sapphire Rapids Xeon) prefers 64-row blocks: 4-8%
// less per 256-row step (81.3 -> 77.2 ms min, argmax only); AVX-512 saw no difference.
#if DELTASERVE_SIMD == 256
constexpr int64_t kGreedyRowBlock = 64;
#else
constexpr int64_t kGreedyRowBlock = 128;
#endif

// The greedy token of each row of x W^T and its log-softmax, tile by tile: each thread keeps a
// streaming argmax per row over its tiles (in column order), then the partial states are folded.
// logprobs false: the argmax alone (no exponential; an empty logprob tensor comes back).
std::tuple<at::Tensor, at::Tensor> mkl_tiled_greedy(const at::Tensor& x,
                                                    const std::vector<at::Tensor>& tiles,
                                                    int64_t tile_n, int64_t n, bool logprobs) {
  check_tiled(x, tiles, tile_n, n);
  const int64_t m = x.size(0), k = x.size(1), num_tiles = static_cast<int64_t>(tiles.size());
  at::Tensor ids = at::empty({m}, x.options().dtype(at::kLong));
  at::Tensor lps = at::empty({logprobs ? m : 0}, x.options());
  if (m == 0) return {ids, lps};
  const int nt = threads_for(num_tiles);
  const int64_t row_block = nt == 1 ? std::min(m, kGreedyRowBlock) : m;
  std::vector<RowArgmax> states(static_cast<size_t>(nt * m));
  const float* xp = x.data_ptr<float>();
#pragma omp parallel num_threads(nt)
  {
    const int me = omp_get_thread_num();
    RowArgmax* mine = states.data() + me * m;
    for (int64_t r = 0; r < m; ++r) mine[r].reset();
    std::vector<float> buf(static_cast<size_t>(row_block * tile_n));
    // Dynamic: a thread slowed by other work (the engine's own thread shares these cores)
    // hands its tiles to the other instead of holding up the join. Each thread still takes
    // its tiles in column order, and finish_rows breaks ties across threads by index.
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t cols = std::min(tile_n, n - t * tile_n);
      for (int64_t r0 = 0; r0 < m; r0 += row_block) {
        const int64_t rows = std::min(row_block, m - r0);
        tiled_compute(xp + r0 * k, rows, k, tiles, tile_n, n, t, buf.data(), tile_n);
        for (int64_t r = 0; r < rows; ++r)
          mine[r0 + r].feed(buf.data() + r * tile_n, cols, t * tile_n, logprobs);
      }
    }
  }
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = logprobs ? lps.data_ptr<float>() : nullptr;
  std::vector<RowArgmax> row(static_cast<size_t>(nt));
  for (int64_t r = 0; r < m; ++r) {
    for (int p = 0; p < nt; ++p) row[p] = states[p * m + r];
    finish_rows(row.data(), nt, ip + r, lp ? lp + r : nullptr);
  }
  return {ids, lps};
}

// x [M, K] bf16, weight [N, K] bf16, bias [N] bf16 -> bf16 [M, N]: float32 accumulation, the
// bias added in float32, one rounding.
at::Tensor mkl_bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(mkl().gemm_bf16, "MKL bf16 gemm is not available in this torch build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "x [M, K] and weight [N, K] must be contiguous bfloat16");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor y32 = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m > 0) {
    mkl().gemm_bf16(kRowMajor, kNoTrans, kTrans, static_cast<int>(m), static_cast<int>(n),
                    static_cast<int>(k), 1.0f,
                    reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()),
                    static_cast<int>(k),
                    reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>()),
                    static_cast<int>(k), 0.0f, y32.data_ptr<float>(), static_cast<int>(n));
  }
  if (bias.has_value() && bias->defined()) {
    at::Tensor b = bias->to(at::kFloat).contiguous();
    add_bias_rows(y32.data_ptr<float>(), b.data_ptr<float>(), m, n);
  }
  return y32.to(at::kBFloat16);
}

}  // namespace deltaserve_cpu
