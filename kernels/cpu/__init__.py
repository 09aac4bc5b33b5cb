"""CPU kernels compiled from C++ at first use (or by `make install`): paged attention that reads
the KV cache in place, and linear layers through MKL's packed float32 GEMM and its bf16 GEMM.

extension  builds and loads the `deltaserve_cpu` operator library (torch.ops.deltaserve_cpu)
linear     F.linear's CPU stand-in: packed float32 weights, the bf16 GEMM, with fallbacks
moe_experts  a MoE layer's routed experts: every expert panel-packed, one call per layer
csrc/      the C++ sources
"""
