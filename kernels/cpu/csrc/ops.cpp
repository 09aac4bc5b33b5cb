// The deltaserve_cpu operator library: torch.ops.<DELTASERVE_CPU_NS>.<name>, where the build
// names the namespace (deltaserve_cpu, or deltaserve_cpu_avx2 / _generic for the narrower builds
// kernels/cpu/extension.py makes, so that one process can load several).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#ifndef DELTASERVE_CPU_NS
#define DELTASERVE_CPU_NS deltaserve_cpu
#endif
// TORCH_LIBRARY pastes its argument: one more level so that the macro's value is pasted
#define DELTASERVE_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

namespace deltaserve_cpu {
void paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens, double scale, at::Tensor& out, int64_t window,
                     const std::optional<at::Tensor>& sinks);
bool mkl_sgemm_packed_available();
bool mkl_bf16_available();
at::Tensor mkl_pack(const at::Tensor& weight);
at::Tensor mkl_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                             const std::optional<at::Tensor>& bias);
at::Tensor mkl_bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias);
at::Tensor mkl_tiled_linear(const at::Tensor& x, const std::vector<at::Tensor>& tiles,
                            int64_t tile_n, int64_t n, const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> mkl_tiled_greedy(const at::Tensor& x,
                                                    const std::vector<at::Tensor>& tiles,
                                                    int64_t tile_n, int64_t n, bool logprobs);

at::Tensor panel_pack(const at::Tensor& weight);
bool panel_bf16_dot();
at::Tensor panel_linear_many(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                             const std::optional<at::Tensor>& bias);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n,
                        const std::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps);
void rope(const at::Tensor& positions, at::Tensor query, at::Tensor key,
          const at::Tensor& cos_cache, const at::Tensor& sin_cache);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const at::Tensor& w13_panels, const at::Tensor& w2_panels, int64_t inter,
                       const std::optional<at::Tensor>& w13_bias,
                       const std::optional<at::Tensor>& w2_bias, c10::string_view activation,
                       double alpha, double limit);
std::tuple<at::Tensor, at::Tensor> greedy_sample(const at::Tensor& logits, bool logprobs);
bool screen_available();
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> screen_pack(const at::Tensor& weight);
at::Tensor screen_greedy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                         const at::Tensor& scale, const at::Tensor& floor,
                         const at::Tensor& bounds);
at::Tensor int4pack_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                           int64_t group, int64_t n, int64_t block, bool interleaved);
at::Tensor int4pack_dequantize(const at::Tensor& packed, const at::Tensor& sz, int64_t group,
                               int64_t n, int64_t block, bool interleaved);

namespace {
void paged_attention_op(const at::Tensor& query, const at::Tensor& kv_cache,
                        const at::Tensor& block_table, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, double scale, at::Tensor out,
                        int64_t window, const std::optional<at::Tensor>& sinks) {
  paged_attention(query, kv_cache, block_table, query_start_loc, seq_lens, scale, out, window,
                  sinks);
}

// Which vector bodies this build compiled: "avx512", "avx2" or "generic" (portable loops).
std::string body() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "generic";
#endif
}

// Whether a bfloat16 cache's prefill tiles use AVX512-BF16 dot products (attention_bf16dot.h).
bool bf16_dot() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
}  // namespace

DELTASERVE_TORCH_LIBRARY(DELTASERVE_CPU_NS, m) {
  m.def("body() -> str", &body);
  m.def("bf16_dot() -> bool", &bf16_dot);
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, Tensor(a!) out, int window=0, "
        "Tensor? sinks=None) -> ()",
        &paged_attention_op);
  m.def("mkl_sgemm_packed_available() -> bool", &mkl_sgemm_packed_available);
  m.def("mkl_bf16_available() -> bool", &mkl_bf16_available);
  m.def("mkl_pack(Tensor weight) -> Tensor", &mkl_pack);
  m.def("mkl_packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor",
        &mkl_packed_linear);
  m.def("mkl_bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &mkl_bf16_linear);
  m.def("mkl_tiled_linear(Tensor x, Tensor[] tiles, int tile_n, int n, Tensor? bias) -> Tensor",
        &mkl_tiled_linear);
  m.def("mkl_tiled_greedy(Tensor x, Tensor[] tiles, int tile_n, int n, bool logprobs=True) "
        "-> (Tensor, Tensor)", &mkl_tiled_greedy);
  m.def("panel_pack(Tensor weight) -> Tensor", &panel_pack);
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor", &panel_linear);
  m.def("panel_bf16_dot() -> bool", &panel_bf16_dot);
  m.def("panel_linear_many(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor",
        &panel_linear_many);
  m.def("int4pack_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group, int n, "
        "int block, bool interleaved) -> Tensor", &int4pack_linear);
  m.def("int4pack_dequantize(Tensor packed, Tensor scales_and_zeros, int group, int n, "
        "int block, bool interleaved) -> Tensor", &int4pack_dequantize);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor",
        &add_rms_norm);
  m.def("rope(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_cache, "
        "Tensor sin_cache) -> ()", &rope);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor w13_panels, Tensor w2_panels, "
        "int inter, Tensor? w13_bias=None, Tensor? w2_bias=None, str activation='silu', "
        "float alpha=0., float limit=0.) -> Tensor", &moe_experts);
  m.def("greedy_sample(Tensor logits, bool logprobs=True) -> (Tensor, Tensor)", &greedy_sample);
  m.def("screen_available() -> bool", &screen_available);
  m.def("screen_pack(Tensor weight) -> (Tensor, Tensor, Tensor, Tensor)", &screen_pack);
  m.def("screen_greedy(Tensor x, Tensor weight, Tensor packed, Tensor scale, Tensor floor, "
        "Tensor bounds) -> Tensor", &screen_greedy);
}

}  // namespace deltaserve_cpu
