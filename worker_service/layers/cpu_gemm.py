"""The CPU GEMM hook of the linear layers (linear.py, and the LM head in embedding.py).

After the weights are loaded on a CPU device, cpu_kernels.use_cpu_kernels(model) gives every such
layer a kernels/cpu/linear.CpuLinear (MKL packed float32 / bf16 GEMMs); `matmul` then runs
through it, falling back to F.linear for shapes it does not take. Elsewhere (CUDA, the library
missing) layers keep F.linear.

A GPTQ / AWQ checkpoint loaded with native CPU weights (quant_checkpoint.py's `read_packed`)
hands the linear layers packed pieces instead: `take_packed` keeps them, and once the rank's
whole weight is in, `cpu_linear` becomes a layers/quant_linear.QuantLinear and the dense
weight is never written (a dense weight's CpuLinear lets it go the same way once packed:
release_dense_weight) (a one-element NaN seen as [out, in]: any use that bypasses `matmul`
gives NaN, never a silent zero). What its kernels cannot run is dequantized into the weight.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.cpu import linear as cpu_linear
from worker_service.layers import quant_linear


class CpuGemm:
    """Mixin for a module with a `weight` [out, in]: `matmul(x, bias)` = F.linear(x, W, bias)."""

    cpu_linear: cpu_linear.CpuLinear | quant_linear.QuantLinear | None = None
    packed_rows: quant_linear.PackedRows | None = None
    dense_released = False

    def use_cpu_kernels(self) -> bool:
        if isinstance(self.cpu_linear, quant_linear.QuantLinear) or self.dense_released:
            return True                           # the weight is only in the packs now
        if self.packed_rows is not None:          # some pieces came plain: all dense
            self.packed_rows.write_dequantized(self.weight.data)
            self.packed_rows = None
        self.cpu_linear = cpu_linear.prepare(self.weight.data, self.asks_greedy())
        return self.cpu_linear is not None

    def asks_greedy(self) -> bool:
        """Whether this layer asks its CpuLinear for greedy() (the LM head): only then does a
        wide float32 weight keep the AVX2 build's screen, and the weight with it."""
        return False

    def release_dense_weight(self) -> bool:
        """Once a CpuLinear holds the weight's panels and pack and reads nothing else, let
        the parameter's data go: a one-element NaN seen as [out, in] (shape reads work, any
        value read is NaN). The caller checks no other module shares the parameter."""
        lin = self.cpu_linear
        if not isinstance(lin, cpu_linear.CpuLinear) or lin.weight is not None:
            return False
        _stand_in(self.weight)
        self.dense_released = True
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.cpu_linear is not None:
            return self.cpu_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def take_packed(self, param: torch.Tensor, loaded: Any, rows: tuple[int, int] | None,
                    cols: tuple[int, int] | None, offset: int = 0) -> bool:
        """Keep `loaded`'s packed band (rows / cols of the checkpoint weight; None: all) at
        output row `offset` when it has one (True); False: load it dense as before."""
        read = getattr(loaded, "read_packed", None)
        if read is None or param is not self.weight or not self._runs_as_linear():
            return False
        band = read(rows, cols)
        if band is None:                          # act order: no kernel layout (quant_regions)
            return False
        if self.packed_rows is None:
            self.packed_rows = quant_linear.PackedRows(*self.weight.shape)
        self.packed_rows.add(offset, band)
        if self.packed_rows.complete:
            self._build_packed()
        return True

    def _runs_as_linear(self) -> bool:
        """False for a layer that opts out of the CPU GEMMs (MLA's kv_b_proj overrides
        use_cpu_kernels): it reads its weight as matrices, so the weight must be dense."""
        return type(self).use_cpu_kernels is CpuGemm.use_cpu_kernels

    def _build_packed(self) -> None:
        weight = self.weight
        built = quant_linear.build(self.packed_rows.joined(), weight.dtype)
        if isinstance(built, str):
            quant_linear.log_fallback(f"{type(self).__name__} {tuple(weight.shape)}", built)
            self.packed_rows.write_dequantized(weight.data)
        else:
            self.cpu_linear = built
            _stand_in(weight)
        self.packed_rows = None


def _stand_in(weight: torch.Tensor) -> None:
    """Let the parameter's data go once the kernels hold it: a one-element NaN seen as its
    shape (shape reads work; any value read is NaN, never a silent zero)."""
    weight.data = torch.full((1, 1), float("nan"), dtype=weight.dtype).expand(*weight.shape)
