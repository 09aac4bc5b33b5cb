"""The routed experts of a sparse MoE block as two grouped Triton GEMMs, with no host sync.

    fused_experts(x [T, H], w13 [E, 2 * I, H], w2 [E, H, I], weights [T, k], ids [T, k])
        -> [T, H] = sum over each token's k slots of weight * down(silu(gate(x)) * up(x))

Same contract as worker_service/layers/moe.py MoEExperts' grouped path (weights stacked as it
lays them out: w13 holds an expert's gate rows then its up rows), so a CUDA graph can capture it:
kernels/moe_align.py groups the (token, slot) pairs by expert into blocks of BLOCK_M rows on the
device, then

  1. gate_up: one program per (block, BLOCK_N columns of I) loads its block's tokens' rows of x,
     multiplies them by its expert's gate and up rows (two accumulators over H) and writes
     silu(gate) * up for each slot, h [T * k, I];
  2. down: one program per (block, BLOCK_N columns of H) multiplies the block's rows of h by its
     expert's down weights and writes weight * result for each slot, [T * k, H];

and the k slots of each token are summed (torch). The grids are sized for the worst case
(kernels/moe_align.max_blocks); a program whose block is past the routing's valid blocks reads
the count on the device and returns. Rounding follows the torch path: gate, up and h are
rounded to x's dtype where torch's linear outputs would be; float32 dots run in IEEE float32
(no TF32), so float32 results agree with the torch path to summation order. The interpreter
cannot tl.dot bfloat16 (garbage in triton 3.9), so on CPU the tiles go to float32 first: the
products of bf16 operands are exact in float32, as a GPU's bf16 dot with float32 accumulation.

Tile sizes are untuned (vLLM's untuned defaults: small M tiles when there are about as few
pairs as experts, as in decode). On CPU the kernels run only under the Triton interpreter
(TRITON_INTERPRET=1 before triton is imported, as tests/conftest.py arranges).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.moe_align import MoeAlignment, align_by_expert

BLOCK_N = 64
BLOCK_K = 32
SMALL_BLOCK_M = 16       # tl.dot's smallest M: decode batches give most experts a row or two
LARGE_BLOCK_M = 64


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block, from shapes only (fixed per captured batch size)."""
    return SMALL_BLOCK_M if num_pairs <= 4 * num_experts else LARGE_BLOCK_M


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, slots_ptr, block_expert_ptr, num_blocks_ptr,
                    top_k, num_pairs, hidden, inter, stride_xm, stride_we, stride_wn, stride_hm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, ON_GPU: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slots < num_pairs
    tokens = slots // top_k
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w_ptr + expert * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        up = tl.load(w_base + (cols + inter)[None, :] * stride_wn + ks[:, None], mask=w_mask,
                     other=0.0)
        if not ON_GPU:      # the interpreter cannot tl.dot bf16/fp16 (exact in fp32 anyway)
            a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
    out_ty = h_ptr.dtype.element_ty
    g = acc_gate.to(out_ty).to(tl.float32)          # torch rounds each linear's output
    u = acc_up.to(out_ty).to(tl.float32)
    if ON_GPU:
        e = libdevice.exp(-g)
    else:                                           # the interpreter has no libdevice
        e = tl.exp(-g)
    silu = tl.math.div_rn(g, 1.0 + e).to(out_ty).to(tl.float32)
    tl.store(h_ptr + slots[:, None] * stride_hm + cols[None, :], (silu * u).to(out_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, out_ptr, weights_ptr, slots_ptr, block_expert_ptr,
                 num_blocks_ptr, num_pairs, hidden, inter, stride_hm, stride_we, stride_wn,
                 stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, ON_GPU: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slots < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + slots[:, None] * stride_hm + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if not ON_GPU:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out_ty = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)
    y = acc.to(out_ty).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + slots[:, None] * stride_om + cols[None, :], y.to(out_ty),
             mask=valid[:, None] & col_ok[None, :])


def _unit_last_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} of strides {t.stride()}: the kernels need a unit last stride")


def expert_gemms(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 align: MoeAlignment, top_k: int) -> torch.Tensor:
    """The two grouped GEMMs over an alignment: [T * k, H], slot s = weights[s] * expert(x)."""
    num_pairs, hidden, inter = x.shape[0] * top_k, x.shape[1], w2.shape[2]
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        _unit_last_stride(name, t)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    per_slot = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if align.max_blocks == 0:
        return per_slot
    precision = "ieee" if x.dtype == torch.float32 else "tf32"   # tf32 only matters for fp32
    block_m = align.block_m
    _gate_up_kernel[(align.max_blocks, triton.cdiv(inter, BLOCK_N))](
        x, w13, h, align.sorted_slots, align.block_expert, align.num_blocks, top_k, num_pairs,
        hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision,
        ON_GPU=x.is_cuda, num_warps=4)
    _down_kernel[(align.max_blocks, triton.cdiv(hidden, BLOCK_N))](
        h, w2, per_slot, weights.contiguous(), align.sorted_slots, align.block_expert,
        align.num_blocks, num_pairs, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
        per_slot.stride(0), BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION=precision, ON_GPU=x.is_cuda, num_warps=4)
    return per_slot


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2 * I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H] in x's dtype."""
    num_tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    if w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}: w13 needs 2 * I rows")
    if num_tokens == 0:
        return x.new_zeros(0, x.shape[1])
    align = align_by_expert(ids, num_experts, block_m_for(num_tokens * top_k, num_experts))
    per_slot = expert_gemms(x, w13, w2, weights, align, top_k)
    return per_slot.view(num_tokens, top_k, -1).sum(dim=1)
