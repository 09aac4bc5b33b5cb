"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu.fused import ops_for


class SiluAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate | up] -> silu(gate) * up, shape [..., I]. After
    use_cpu_kernels(), 2-D contiguous CPU inputs take kernels/cpu's one-pass kernel.
    fused=True runs kernels/fused_silu_mul.py's Triton kernel instead (same rounding; needs
    CUDA or Triton's interpreter): one launch instead of two."""

    _cpu = None

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self._fused_kernel = None
        if fused:
            from kernels.fused_silu_mul import silu_and_mul
            self._fused_kernel = silu_and_mul

    def use_cpu_kernels(self) -> bool:
        if self._fused_kernel is None:
            self._cpu = ops_for(torch.float32)
        return self._cpu is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._cpu is not None and x.device.type == "cpu" and x.dim() == 2
                and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16)):
            return self._cpu.silu_and_mul(x)
        if self._fused_kernel is not None:
            return self._fused_kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
