"""GPTQ / AWQ weights kept packed on the CPU (weight-only W4A16 / W8A16) instead of dequantized
at load: the linear layer streams about 0.5 byte a parameter (4-bit) per decode step, not 2 or 4.

torch's CPU kernels (aten/src/ATen/native/cpu/int4mm_kernel.cpp, LinearAlgebra.cpp):

    _convert_weight_to_int4pack_for_cpu(q int32 [N, K] in 0 .. 15, 2) -> uint8 [N, K / 2]
    _weight_int4pack_mm_for_cpu(x [M, K], packed, group, scales_and_zeros [K / group, N, 2])
        w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n],  g = k // group
        group in 32, 64, 128, 256; N a multiple of 16; x float32, bfloat16 or float16 and
        scales_and_zeros of x's dtype
    _weight_int8pack_mm(x [M, K], w int8 [N, K], scales [N])  w[n, k] * scales[n]

From int4_gemm.MIN_ROWS rows on (prefill, big batches) an int4 linear runs the repo's own kernel
on the same packed tensor instead (kernels/cpu/int4_gemm.py: W expanded a chunk at a time into
a small scratch reused by every row; torch's kernel re-expands W for every 4 rows, 0.4x the
dequantized GEMM at 300 rows). No other copy of W is kept.

GPTQ's and AWQ's W = s * (q - z) is the int4 form with zero = (8 - z) * s. A checkpoint group
larger than 256 (group_size -1: one group of all K) is written as several kernel groups with the
same scale and zero. 8 bits take the int8 kernel only with one group per output row and every
q - z in [-128, 127] (symmetric GPTQ's zero 128); anything else the kernels cannot express
(4-bit groups under 32, an output band not a multiple of 16) is dequantized at load as before,
its reason logged once per layer shape.

Used for bfloat16 models only (NATIVE_DTYPES: torch's float32 and float16 paths are scalar,
5-45x slower than the dequantized GEMMs here); float32 / float16 models are dequantized at load.

Numerics: float32 activations give F.linear on the dequantized weight to ~1e-6 (relative, the
order of summation differs). bfloat16 activations keep scale and zero in bfloat16 (the
kernel's rule), so (8 - z) * s is rounded once more than the dequantized weight is: ~4e-3
relative on a linear's output (tests/unit/worker_service/layers/test_quant_linear.py).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from kernels.cpu import int4_gemm

KERNEL_GROUPS = (256, 128, 64, 32)
# activations the kernels run fast: torch 2.13's int4 CPU kernel vectorizes bfloat16 only; its
# float32 and float16 paths are scalar (on the 2-core Zen 4, a [12288, 2048] linear at 1 row:
# float32 118 ms and float16 134 ms against 22 / 21 ms dequantized; bfloat16 12 ms against 17-25),
# so those models stay dequantized (tests widen this to check the float32 numerics)
NATIVE_DTYPES = (torch.bfloat16,)
N_MULTIPLE = 16
_INT4_OFFSET = 8

log = logging.getLogger(__name__)
_logged: set[str] = set()


class PackedBand(NamedTuple):
    """One piece of a rank's weight as the checkpoint stores it: codes [rows, cols] (output
    rows first, uint8), integer zeros and float scales [groups, rows], group_size columns a
    group (cols when the band is one group)."""
    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    bits: int


def kernel_group(group_size: int) -> int | None:
    """The int4 kernel's group for a checkpoint group: the largest it takes dividing it."""
    return next((g for g in KERNEL_GROUPS if group_size % g == 0), None)


def native_problem(band: PackedBand, n: int, k: int) -> str | None:
    """Why the kernels cannot run this [n, k] weight (None: they can)."""
    if band.bits == 4:
        if k % band.group_size:
            return f"{k} input columns end in a partial group of {band.group_size}"
        if kernel_group(band.group_size) is None:
            return (f"group_size {band.group_size} is not a multiple of 32 (the int4 kernel "
                    f"takes groups of {', '.join(map(str, KERNEL_GROUPS))})")
        if n % N_MULTIPLE:
            return f"{n} output rows on this rank are not a multiple of {N_MULTIPLE}"
        return None
    if band.bits == 8:
        if band.group_size != k:
            return ("8-bit with groups: the int8 kernel takes one scale per output row "
                    "(group_size -1)")
        return None
    return f"{band.bits}-bit codes have no CPU kernel"


class QuantLinear:
    """A packed weight [N, K] and its scales as the kernel takes them; called as
    F.linear(x, weight, bias) (CpuGemm's cpu_linear), `weight` ignored."""

    def __init__(self, kind: str, packed: torch.Tensor, scales: torch.Tensor, group: int,
                 n: int, k: int) -> None:
        self.kind, self.packed, self.scales, self.group = kind, packed, scales, group
        self.out_features, self.in_features = n, k
        self.dtype = scales.dtype
        self.calls = 0
        self.many_row_calls = 0     # calls that took int4_gemm's kernel (tests check it ran)

    @property
    def nbytes(self) -> int:
        """Resident bytes: the packed codes and the scales (and zeros)."""
        return self.packed.nbytes + self.scales.nbytes

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"quantized linear [{self.out_features}, {self.in_features}] holds "
                            f"{self.dtype} scales: input dtype {x.dtype} does not match")
        self.calls += 1
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.kind == "int4" and int4_gemm.wanted(x2.shape[0], x2.dtype):
            self.many_row_calls += 1
            y = int4_gemm.linear(x2, self.packed, self.scales, self.group, self.out_features)
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group,
                                                            self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.packed, self.scales)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.out_features)


def build(band: PackedBand, dtype: torch.dtype) -> QuantLinear | str:
    """The kernel's form of a whole [N, K] band, or the reason it has none."""
    n, k = band.codes.shape
    if dtype not in NATIVE_DTYPES:
        return (f"{dtype} activations: torch's int4 / int8 CPU kernels are vectorized for "
                f"{', '.join(map(str, NATIVE_DTYPES))} only")
    problem = native_problem(band, n, k)
    if problem is not None:
        return problem
    s = band.scales.to(torch.float32)
    z = band.zeros.to(torch.float32)
    if band.bits == 8:
        w8 = band.codes.to(torch.int16) - band.zeros.to(torch.int16).t()
        if int(w8.min()) < -128 or int(w8.max()) > 127:
            return "8-bit zero points other than 128 put q - z outside int8"
        return QuantLinear("int8", w8.to(torch.int8), s[0].to(dtype).contiguous(), k, n, k)
    group = kernel_group(band.group_size)
    sz = torch.stack([s, (_INT4_OFFSET - z) * s], dim=-1)            # [G, N, 2]
    sz = sz.repeat_interleave(band.group_size // group, dim=0).to(dtype).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(band.codes.to(torch.int32), 2)
    return QuantLinear("int4", packed, sz, group, n, k)


def dequantize(band: PackedBand) -> torch.Tensor:
    """W [rows, cols] float32 = s * (q - z), the load-time path's value."""
    rows, cols = band.codes.shape
    groups = torch.arange(cols) // band.group_size
    w = band.codes.to(torch.float32).t()                             # [cols, rows]
    w = (w - band.zeros.to(torch.float32)[groups]) * band.scales.to(torch.float32)[groups]
    return w.t()


def log_fallback(name: str, reason: str) -> None:
    """One log line per distinct reason: the layer stays dequantized."""
    if reason not in _logged:
        _logged.add(reason)
        log.info("%s: quantized weight dequantized at load (%s)", name, reason)


class PackedRows:
    """A layer's packed pieces as they load (q, k, v or gate, up at their output-row offsets),
    joined into one band once they cover all [n, k] of the rank's weight."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.pieces: list[tuple[int, PackedBand]] = []

    def add(self, offset: int, band: PackedBand) -> None:
        rows, cols = band.codes.shape
        if cols != self.k or offset < 0 or offset + rows > self.n:
            raise ValueError(f"packed piece [{rows}, {cols}] at row {offset} does not fit the "
                             f"weight [{self.n}, {self.k}]")
        self.pieces.append((offset, band))

    @property
    def complete(self) -> bool:
        return sum(b.codes.shape[0] for _, b in self.pieces) == self.n

    def joined(self) -> PackedBand:
        """The pieces in row order as one band (they share bits and group size)."""
        bands = [b for _, b in sorted(self.pieces, key=lambda p: p[0])]
        first = bands[0]
        if any((b.bits, b.group_size) != (first.bits, first.group_size) for b in bands):
            raise ValueError("packed pieces of one layer differ in bits or group size")
        return PackedBand(torch.cat([b.codes for b in bands]),
                          torch.cat([b.zeros for b in bands], dim=1),
                          torch.cat([b.scales for b in bands], dim=1),
                          first.group_size, first.bits)

    def write_dequantized(self, weight: torch.Tensor) -> None:
        """The fallback: each piece dequantized into its rows of the dense weight."""
        for offset, band in self.pieces:
            weight[offset:offset + band.codes.shape[0]].copy_(dequantize(band))
        self.pieces.clear()
