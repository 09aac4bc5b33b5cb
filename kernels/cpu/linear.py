"""F.linear's CPU stand-in: y = x W^T + b through the deltaserve_cpu library's MKL GEMMs.

    float32   W packed once into MKL's blocked layout (cblas_sgemm_pack), then
              cblas_sgemm_compute for every call: 1.2-2x F.linear's speed at 8-128 rows
    bfloat16  cblas_gemm_bf16bf16f32 (float32 accumulation, one rounding): several times the
              speed of F.linear's oneDNN path on CPUs without native bf16 dot products
    wide      a float32 weight of TILED_FROM_N rows or more (an LM head) is packed as column
              tiles of TILE_N outputs, each written while it fits in L2; `greedy(x)` runs the
              same tiles into a streaming argmax + log-sum-exp, so a greedy step never
              materialises its logits (about 1.3x the GEMM alone plus the sampler's pass)

A call with fewer than MIN_ROWS rows (a matrix-vector product, where MKL's gemv is better), a
non-2-D input, or any dtype but these two goes to F.linear, as does everything when the library
is not loaded. The packed copy is made from the weight at prepare time: re-prepare after changing
the weight. It must not be moved (MKL's packed data depends on its address), so it is a plain
attribute, never a parameter or buffer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import extension

MIN_ROWS = 4
TILE_N = 2048
TILED_FROM_N = 8192


class CpuLinear:
    """One weight prepared for the CPU GEMMs; call it as F.linear(x, weight, bias)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        self.packed = None
        self.tiles: list[torch.Tensor] | None = None
        w = weight.detach().contiguous()
        if weight.dtype == torch.float32 and self.out_features >= TILED_FROM_N:
            pack = extension.ops().mkl_pack
            self.tiles = [pack(w[i:i + TILE_N].contiguous())
                          for i in range(0, self.out_features, TILE_N)]
        elif weight.dtype == torch.float32:
            self.packed = extension.ops().mkl_pack(w)
        self.calls = 0              # calls that took the MKL path (tests check it ran)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] < MIN_ROWS or x.dtype != self.dtype:
            return F.linear(x, weight, bias)
        self.calls += 1
        if self.tiles is not None:
            return extension.ops().mkl_tiled_linear(x.contiguous(), self.tiles, TILE_N,
                                                    self.out_features, bias)
        if self.packed is not None:
            return extension.ops().mkl_packed_linear(x.contiguous(), self.packed,
                                                     self.out_features, bias)
        return extension.ops().mkl_bf16_linear(x.contiguous(), weight, bias)

    @property
    def fuses_greedy(self) -> bool:
        return self.tiles is not None

    def greedy(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax of x W^T per row (first on ties), its log-softmax) without the logits;
        x: float32 [M, K]. Only when fuses_greedy."""
        self.calls += 1
        return extension.ops().mkl_tiled_greedy(x.contiguous(), self.tiles, TILE_N,
                                                self.out_features)


def prepare(weight: torch.Tensor) -> CpuLinear | None:
    """A CpuLinear for a CPU weight this module can run faster than F.linear, else None."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not extension.load():
        return None
    ops = extension.ops()
    if weight.dtype == torch.float32 and ops.mkl_sgemm_packed_available():
        return CpuLinear(weight)
    if weight.dtype == torch.bfloat16 and ops.mkl_bf16_available():
        return CpuLinear(weight)
    return None
