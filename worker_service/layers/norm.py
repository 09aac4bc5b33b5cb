"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu.fused import ops_for
from worker_service.layers.sharding import default_weight_loader, new_param


class ResidualInterface:
    """Mixin giving a plain norm module RMSNorm's residual interface: forward(x) -> normed,
    forward(x, residual) -> (norm(x + residual), x + residual). List it before the norm class."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the statistics taken in float32.

    forward(x)           -> normed
    forward(x, residual) -> (normed, new_residual) where new_residual = x + residual, the
                            value the next residual add starts from.

    fused=True runs kernels/fused_norm.py's Triton kernel instead (same rounding; needs CUDA or
    Triton's interpreter), one launch for the add and the norm. On the CPU, after
    use_cpu_kernels(), 2-D contiguous inputs take kernels/cpu's one-pass kernel, which adds x
    into the residual IN PLACE and returns that tensor as the new residual.
    """

    _cpu = None

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None,
                 fused: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.fused = fused
        self._fused_kernel = _load_fused_kernel() if fused else None
        self.weight = new_param((hidden_size,), dtype, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def use_cpu_kernels(self) -> bool:
        if not self.fused and self.weight.device.type == "cpu":
            self._cpu = ops_for(self.weight.dtype)
        return self._cpu is not None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self._cpu is not None and x.dim() == 2 and x.is_contiguous() and (
                residual is None or residual.is_contiguous()):
            if residual is None:
                return self._cpu.rms_norm(x, self.weight, self.eps)
            return self._cpu.add_rms_norm(x, residual, self.weight, self.eps), residual
        if self._fused_kernel is not None:
            return self._fused_kernel(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, fused={self.fused}"


def _load_fused_kernel():
    """kernels.fused_norm.rms_norm, imported only when asked for (it imports triton)."""
    from kernels.fused_norm import rms_norm
    return rms_norm
