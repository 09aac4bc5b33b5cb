"""A mixture-of-experts layer's routed experts on the CPU (worker_service/layers/moe.py): every
expert's stacked gate_up [E, 2I, H] and down [E, H, I] weights repacked once, at load, into the
panels of csrc/panel_gemm.cpp ([E, panels, K, 32], the dense layers' decode layout, bfloat16
kept bfloat16), and one deltaserve_cpu.moe_experts call per layer (csrc/moe_experts.cpp): the
grouping by expert, both GEMMs of every expert that received tokens in one parallel region,
silu(gate) * up between them, and each token's weighted sum over its top-k. GPT-OSS's experts
(worker_service/layers/gpt_oss_moe.py) add per-expert biases (kept float32 here) and take its
clamped SwiGLU (ClampedSwiGLU, passed per call) in place of silu, in the same call.

Taken while the experts get at most MAX_MEAN_ROWS[dtype] rows on average (tokens x top-k <=
that x experts): decode steps and short prefills; longer prefills keep the grouped torch path.
The crossover, one block at E=64 top-8 H=1024 I=512 on the quiet 2-core Sapphire Rapids VM,
grouped / packed (medians of 3 rounds): float32 2.1x at 32 rows an expert, 1.4x at 64, 1.0x at
128; bfloat16 1.5x at 8 rows, 1.07x at 16, 0.83x at 32 (F.linear's bf16 GEMM uses the CPU's
AMX tiles once there are rows enough; the panels widen bf16 to float32 FMAs). An expert that
gets many more rows than the mean still runs correctly, on the panels' k-chunked walk.

The panels are the experts' only copy once loaded: the layers let their parameters go
(worker_service/layers/moe.py's PackedExperts), and a longer prefill's grouped torch path runs
each expert's GEMMs on the panels in place (expert_linear: float32 on csrc/panel_gemm.cpp's row
blocks, bfloat16 on csrc/panel_gemm_bf16dot.cpp's AVX512-BF16 pairs; a bfloat16 build without
them copies one expert's weight out at a time, expert_weights). packed_bytes gives the panels'
size before anything is loaded and bytes_beyond_weights what they hold beyond one dense copy
(the padding to whole panels, the biases' float32 copies), for the memory check
(worker_service/runner/memory_fit.py) that budgets the weights beside the KV cache.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.cpu import extension

DTYPES = (torch.float32, torch.bfloat16)
MAX_MEAN_ROWS = {torch.float32: 64, torch.bfloat16: 16}
PANEL_COLUMNS = 32          # csrc/panel_gemm.cpp's kPanel: output columns per panel


def packed_bytes(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 biases: bool = False) -> int:
    """Bytes of one layer's CpuExperts panels (w13 [E, 2I, H] and w2 [E, H, I], each expert's
    output rows padded up to whole panels), plus with `biases` (GPT-OSS) the float32 copies of
    [E, 2I] and [E, H] a bfloat16 layer keeps; 0 for a dtype the kernel does not take."""
    if dtype not in DTYPES or num_experts < 1:
        return 0
    panels = -(-2 * inter // PANEL_COLUMNS) * hidden + -(-hidden // PANEL_COLUMNS) * inter
    bias_copies = num_experts * (2 * inter + hidden) * 4 if biases and dtype != torch.float32 else 0
    return (num_experts * panels * PANEL_COLUMNS * torch.empty((), dtype=dtype).element_size()
            + bias_copies)


def bytes_beyond_weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                         biases: bool = False) -> int:
    """packed_bytes less one dense copy of w13 and w2 (the parameters the panels replace): the
    padding to whole panels and a bfloat16 layer's float32 biases; 0 for a dtype the kernel
    does not take."""
    packed = packed_bytes(num_experts, hidden, inter, dtype, biases)
    if packed == 0:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    return packed - num_experts * 3 * hidden * inter * element


class ClampedSwiGLU(NamedTuple):
    """GPT-OSS's activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
    g = clamp(gate, max=limit)."""
    alpha: float
    limit: float


class CpuExperts:
    """The packed experts of one layer; call it as MoEExperts.forward(x, weights, ids), plus
    the activation for experts that do not use silu(gate) * up."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None) -> None:
        ops = extension.ops()
        self.dtype = w13.dtype
        self.inter = w2.shape[2]
        self.hidden = w2.shape[1]
        self.num_experts = w13.shape[0]
        self.max_mean_rows = MAX_MEAN_ROWS[self.dtype]   # a step over it: the grouped path
        self.w13_panels = _stacked_panels(ops, w13)
        self.w2_panels = _stacked_panels(ops, w2)
        # [E, 2I] and [E, H] in float32 (bfloat16 widens exactly; float32 is not copied)
        self.w13_bias = None if w13_bias is None else w13_bias.float().contiguous()
        self.w2_bias = None if w2_bias is None else w2_bias.float().contiguous()
        self.calls = 0              # calls that took the kernel (tests check it ran)
        # the grouped path's GEMMs on the panels themselves (expert_linear): float32 always
        # (panel_gemm.cpp's row blocks keep up with MKL), bfloat16 with AVX512-BF16 pairs
        self.reads_panels_in_place = self.dtype == torch.float32 or ops.panel_bf16_dot()

    @property
    def nbytes(self) -> int:
        biases = sum(b.nbytes for b in (self.w13_bias, self.w2_bias)
                     if b is not None and self.dtype != torch.float32)
        return self.w13_panels.nbytes + self.w2_panels.nbytes + biases

    def takes(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype == self.dtype and x.device.type == "cpu"
                and ids.numel() <= self.max_mean_rows * self.num_experts)

    def expert_linear(self, x: torch.Tensor, expert: int, down: bool,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, w, bias) for one expert's w13 [2I, H] (or w2 [H, I] with `down`), x [M, K]
        in the experts' dtype, computed on the panels: float32 and (with AVX512-BF16) bfloat16
        read them in place (csrc/panel_gemm*.cpp); a bfloat16 body without the dot products
        runs F.linear on a transient dense copy of the one weight."""
        panels = (self.w2_panels if down else self.w13_panels)[expert]
        n = self.hidden if down else 2 * self.inter
        if self.reads_panels_in_place:
            return extension.ops().panel_linear_many(x.contiguous(), panels, n, bias)
        return F.linear(x, _unpacked(panels, n), bias)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (w13 [2I, H], w2 [H, I]) read back from the panels, as dense
        contiguous copies (the same values: the panels hold the weights unchanged)."""
        return (_unpacked(self.w13_panels[expert], 2 * self.inter),
                _unpacked(self.w2_panels[expert], self.hidden))

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 swiglu: ClampedSwiGLU | None = None) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> [T, H]; silu(gate) * up, or swiglu's clamped
        SwiGLU."""
        self.calls += 1
        args = (x.contiguous(), weights.to(x.dtype).contiguous(), ids.contiguous(),
                self.w13_panels, self.w2_panels, self.inter)
        ops = extension.ops()
        if swiglu is None and self.w13_bias is None and self.w2_bias is None:
            return ops.moe_experts(*args)           # the other MoE models' call, as before
        activation = "silu" if swiglu is None else "clamped_swiglu"
        alpha, limit = swiglu or (0.0, 0.0)
        return ops.moe_experts(*args, self.w13_bias, self.w2_bias, activation, alpha, limit)


def _stacked_panels(ops, w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, ceil(N / 32), K, 32]: each expert's panel_pack, stacked."""
    first = ops.panel_pack(w[0].contiguous())
    out = first.new_empty((w.shape[0], *first.shape))
    out[0] = first
    for e in range(1, w.shape[0]):
        out[e] = ops.panel_pack(w[e].contiguous())
    return out


def _unpacked(panels: torch.Tensor, rows: int) -> torch.Tensor:
    """[ceil(N / 32), K, 32] -> [N, K]: panel p's column c is row 32 p + c (padding dropped)."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:rows]


def prepare(w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
            w2_bias: torch.Tensor | None = None) -> CpuExperts | None:
    """CpuExperts for CPU expert weights in a dtype the kernel takes (and optional per-expert
    biases [E, 2I], [E, H]), else None."""
    if (w13.device.type != "cpu" or w13.dtype not in DTYPES or w2.dtype != w13.dtype
            or w13.shape[0] == 0 or not extension.load()):
        return None
    return CpuExperts(w13, w2, w13_bias, w2_bias)
