"""oneDNN's blocked GEMM (torch's mkldnn linear) for the prefill rows of CPU linears.

On an AVX-512 core it beats MKL's packed sgemm by ~12% in float32 (oneDNN's brgemm kernels;
vLLM-CPU's linears are oneDNN too), and with AVX512-BF16 or AMX it runs bfloat16 as native
dot products, ~2.3x MKL's cblas_gemm_bf16bf16f32 (bench/cpu_gemm_layouts.py,
docs/cpu_performance.md). On an AVX2 core (Zen 4 with AVX-512 hidden) it is 5-25% ahead of
MKL in float32 from 48 rows, and has no bfloat16 GEMM. The avx2 build emulated on a wider CPU
takes it as that AVX2 core does only where oneDNN is capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2,
as `make test-avx2` and bench's `--isa avx2` set): uncapped, oneDNN would pick its AVX-512
kernels, so the emulation would not be AVX2's, and MKL keeps the rows.
DELTASERVE_CPU_ONEDNN=0 turns it off, =1 forces it on (for side-by-side runs).

The weight is reordered once into oneDNN's blocked layout for about PACK_ROWS rows; other row
counts use the same layout (measured 1-4,000 rows without a reorder per call).
"""
from __future__ import annotations

import os

import torch

from kernels.cpu import extension

ENV_SWITCH = "DELTASERVE_CPU_ONEDNN"
PACK_ROWS = 2048
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# What torch's mkldnn linear needs for a bfloat16 weight at all (mkldnn_reorder_linear_weight
# refuses others: an AVX2 CPU has no bf16 oneDNN GEMM, forced or not).
BF16_ISAS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})
# oneDNN's cap on its own kernels' ISA (the second is its older name)
ISA_CAP_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def wanted(dtype: torch.dtype) -> bool:
    """Whether linears of `dtype` run their many-row calls through oneDNN on this process."""
    switch = os.environ.get(ENV_SWITCH, "auto")
    if switch not in ("auto", "0", "1"):
        raise ValueError(f"{ENV_SWITCH}={switch!r} must be auto, 0 or 1")
    if dtype not in (torch.float32, torch.bfloat16) or not _available() or switch == "0":
        return False
    flags = set(extension.cpu_flags().split())
    if dtype == torch.bfloat16 and not bf16_runs(flags):
        return False
    if switch == "1":
        return True
    if extension.avx2_body():       # an AVX2 core's float32 kernels, or not AVX2's at all
        return dtype == torch.float32 and (extension.isa() == "native" or capped_at_avx2())
    if extension.isa() != "native" or "avx512f" not in flags:
        return False
    return dtype == torch.float32 or any(f in flags for f in BF16_FLAGS)


def capped_at_avx2() -> bool:
    """Whether this process's oneDNN is held to AVX2-level kernels (ISA_CAP_VARS)."""
    cap = next((os.environ[v] for v in ISA_CAP_VARS if os.environ.get(v)), "")
    return cap.upper().startswith("AVX2")


def bf16_runs(flags: set[str] | None = None) -> bool:
    """Whether torch's oneDNN linear takes a bfloat16 weight on this CPU at all."""
    flags = set(extension.cpu_flags().split()) if flags is None else flags
    return any(need <= flags for need in BF16_ISAS)


def _available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] in oneDNN's blocked layout (an opaque mkldnn tensor: keep it as a
    plain attribute, never a parameter or buffer)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (contiguous, the weight's dtype) @ W^T + bias, a dense [M, N] tensor."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
