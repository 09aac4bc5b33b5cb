"""GPTQ and AWQ (GEMM) integer weights dequantized at load. Both pack p = 32 / bits codes into
each int32, code k at bits [k * bits, (k + 1) * bits), and store per group of `group_size`
input columns one float scale and one integer zero point per output row:

    W[r, c] = scales[g, r] * (q[c, r] - z[g, r])

GPTQ (AutoGPTQ / GPTQModel, quant_method "gptq"), W [R out, C in]:

    qweight  int32 [C / p, R]    code k of qweight[i, r] is q[i * p + k, r]  (packed over inputs)
    qzeros   int32 [G, R / p]    code k of qzeros[g, j] is z[g, j * p + k]
    scales   float [G, R]
    g_idx    int32 [C]           the group of input column c (act order, desc_act: any order;
                                 absent: c // group_size)

    the v1 format ("gptq") stores every zero point minus one (clamped at 0): z = code + 1, so
    its zeros run 1 .. 2^bits (a stored 15 is zero 16 at 4 bits), as AutoGPTQ's qlinear_cuda,
    ExLlama and vLLM's gptq_gemm read it (AutoGPTQ's older cuda-old kernel wraps 15 to 0)

AWQ (AutoAWQ GEMM, quant_method "awq", 4 bits), packed over OUTPUT rows in AWQ's order:

    qweight  int32 [C, R / 8]    code k of qweight[c, j] is q[c, j * 8 + AWQ_ORDER[k]]
    qzeros   int32 [G, R / 8]    likewise z[g, j * 8 + AWQ_ORDER[k]]
    scales   float [G, R]        group g = c // group_size

The product is taken in float32 and rounded once to the model dtype; (q - z) is a small integer,
so that equals AutoGPTQ's / AutoAWQ's product in the scales' float16.
"""
from __future__ import annotations

import torch

from worker_service.layers.quant_fp8 import check_finite

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., N] -> int32 [..., N, 32 / bits]: code k of each word at bits k * bits."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed codes must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def gptq_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight [C / p, R] -> q [C, R] (packed over input columns): code k of each word
    written straight to input row i * p + k, with no [C / p, R, p] copy to permute."""
    if qweight.dtype != torch.int32:
        raise ValueError(f"packed codes must be int32, got {qweight.dtype}")
    per_word = 32 // bits
    codes = torch.empty(qweight.shape[0], per_word, qweight.shape[1], dtype=torch.int32)
    for k in range(per_word):
        torch.bitwise_and(qweight >> (k * bits), (1 << bits) - 1, out=codes[:, k])
    return codes.view(-1, qweight.shape[1])


def gptq_zeros(qzeros: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """qzeros [G, R / p] -> z [G, R], v1's stored-minus-one undone when zero_offset is 1."""
    return unpack_codes(qzeros, bits).reshape(qzeros.shape[0], -1) + zero_offset


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [N, R / 8] -> codes [N, R] in row order (undoing AWQ_ORDER)."""
    codes = unpack_codes(packed, 4)                      # [N, R / 8, 8]: code k is row AWQ_ORDER[k]
    rows = torch.empty_like(codes)
    rows[..., list(AWQ_ORDER)] = codes
    return rows.reshape(packed.shape[0], -1)


def dequantize_grouped(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor,
                       groups: torch.Tensor, name: str) -> torch.Tensor:
    """q [C, R], per-group z and scales [G, R], groups [C] (each column's group) -> W [R, C]
    float32 = scales[g, r] * (q[c, r] - z[g, r]); a group out of range is refused by name."""
    if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= scales.shape[0]):
        raise ValueError(f"{name}: group index {int(groups.max())} (or {int(groups.min())}) out "
                         f"of range: the scales hold groups [0, {scales.shape[0]})")
    if tuple(z.shape) != tuple(scales.shape) or q.shape[1] != scales.shape[1]:
        raise ValueError(f"{name}: zeros {tuple(z.shape)}, scales {tuple(scales.shape)} and "
                         f"codes {tuple(q.shape)} do not fit: must be [G, R], [G, R], [C, R]")
    groups = groups.long()
    w, zf, sf = q.to(torch.float32), z.to(torch.float32), scales.to(torch.float32)
    size = _run_length(groups, scales.shape[0])
    if size:                   # groups in order: per-group rows broadcast, none gathered
        w.view(-1, size, w.shape[1]).sub_(zf[:, None]).mul_(sf[:, None])
    else:                      # act order, or a partial last group: gather each column's
        w.sub_(zf[groups]).mul_(sf[groups])
    check_finite(w, f"{name}: scales give non-finite weights")
    return w.t()


def _run_length(groups: torch.Tensor, num_groups: int) -> int:
    """n when groups is 0 x n, 1 x n, ... up to num_groups - 1 (every group whole, in order),
    else 0. q - z is a small integer, exact in float32, so both paths give the same bits."""
    count = int(groups.max()) + 1 if groups.numel() else 0
    if not count or count != num_groups or groups.numel() % count:
        return 0
    size = groups.numel() // count
    return size if torch.equal(groups, torch.arange(groups.numel()) // size) else 0
