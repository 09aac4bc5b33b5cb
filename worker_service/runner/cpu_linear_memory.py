"""The bytes a CPU rank's prepared dense linears hold beyond one copy of their weights, for
the memory estimate (memory_fit.kv_room_bytes).

kernels/cpu/linear.CpuLinear keeps two layouts of each weight: the decode panels (N padded to
32 columns) and a pack for many rows (oneDNN's blocked copy, MKL's packed sgemm or its column
tiles for a wide float32 head); layers/cpu_kernels.py then lets the parameter go. So each
linear costs about one copy more than estimate_weight_bytes counts, and a head tied to the
embedding two more (its parameter stays: the embedding reads it). A bfloat16 weight without
oneDNN runs MKL's bf16 GEMM on the parameter itself: the panels are its
only extra copy. Both are counted as dense: a lower bound (the panels pad N to 32 columns; MKL
reserves more than it writes, but only written pages are resident). The AVX2 build's screened head
adds its 16-bit copy and keeps its parameter (screen_bytes). Attention projections and dense MLPs
kept natively quantized (quant_memory.py), MoE experts (their panels beyond the released parameters:
moe_experts.bytes_beyond_weights) and a latent attention's kv_b (read as matrices; its q, kv_a and o
projections are linears) add nothing here.
"""
from __future__ import annotations

import torch


def extra_copy_bytes(linear_elements: int, tied_head_elements: int, dtype: torch.dtype,
                     onednn: bool) -> int:
    """Bytes beyond one dense copy for the prepared linears of linear_elements weights (per
    rank; the head among them unless tied) and a tied head of tied_head_elements, in `dtype`;
    onednn: whether oneDNN packs this dtype (kernels/cpu/onednn_gemm.wanted). 0 for a dtype
    the CPU kernels do not take."""
    if dtype not in (torch.float32, torch.bfloat16):
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    packs = dtype == torch.float32 or onednn      # else the bf16 GEMM reads the parameter
    # untied: panels + pack, the parameter let go (or parameter + panels): one copy more
    return (linear_elements + tied_head_elements * (2 if packs else 1)) * element


def screen_bytes(head_elements: int, tied: bool) -> int:
    """The AVX2 build's screened float32 head (kernels/cpu/linear.screens_heads): its 16-bit
    copy, and an untied head's parameter, which the screen reads (so it stays)."""
    return head_elements * (2 + (0 if tied else 4))
