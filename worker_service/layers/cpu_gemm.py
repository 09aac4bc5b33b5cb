"""The CPU GEMM hook of the linear layers (linear.py, and the LM head in embedding.py).

After the weights are loaded on a CPU device, cpu_kernels.use_cpu_kernels(model) gives every such
layer a kernels/cpu/linear.CpuLinear (MKL packed float32 / bf16 GEMMs); `matmul` then runs
through it, falling back to F.linear for shapes it does not take. Elsewhere (CUDA, the library
missing) layers keep F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import linear as cpu_linear


class CpuGemm:
    """Mixin for a module with a `weight` [out, in]: `matmul(x, bias)` = F.linear(x, W, bias)."""

    cpu_linear: cpu_linear.CpuLinear | None = None

    def use_cpu_kernels(self) -> bool:
        self.cpu_linear = cpu_linear.prepare(self.weight.data)
        return self.cpu_linear is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.cpu_linear is not None:
            return self.cpu_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

