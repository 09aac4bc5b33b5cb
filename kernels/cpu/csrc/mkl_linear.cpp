// Linear layers through the MKL that libtorch_cpu carries (found with dlsym at first use, so a
// torch built without it just reports unavailable):
//
//   float32:  y = x W^T + b with W packed once by cblas_sgemm_pack (MKL's own blocked layout)
//             and cblas_sgemm_compute for any number of rows. PyTorch's own packed path
//             (torch.ops.mkl._mkl_linear) only uses the pack when the rows equal the pack's
//             batch size, and falls back to an unpacked GEMM otherwise.
//   bfloat16: cblas_gemm_bf16bf16f32 (float32 accumulation, rounded to bfloat16 once, as
//             F.linear does), which on CPUs without native bf16 dot products is several times
//             faster than oneDNN's path that F.linear takes.
//
// A packed weight must never be moved or copied: MKL keeps metadata that depends on the
// buffer's address (a uint8 tensor that only this module reads).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <cstdint>
#include <optional>

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
