"""Triton kernel that scatters this step's key/value rows into the paged KV cache.

Cache layout (see kernels/attention/backend.py):

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
    row t of key/value goes to slot = slot_mapping[t] = block * block_size + offset,
    i.e. kv_cache[0 or 1, slot // block_size, slot % block_size, :, :].

One program per token row copies all of that row's heads; a slot of -1 (padding) stores nothing.
An fp8 cache (--kv-cache-dtype) is written as its uint8 view through triton_fp8.encode.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.triton_fp8 import cache_operand, store_cache


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh,            # key strides (token, head); the last dim is contiguous
    stride_vt, stride_vh,            # value strides (token, head)
    stride_c_kv, stride_c_blk, stride_c_row, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # A padded row (slot -1) has zero heads to copy. (A scalar bool in a mask trips the
    # interpreter, so the slot test folds into the head bound.)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    safe_slot = tl.maximum(slot, 0)       # keeps padded rows' (masked) addresses in range
    block = safe_slot // BLOCK_SIZE
    row = safe_slot % BLOCK_SIZE
    dst = cache_ptr + block * stride_c_blk + row * stride_c_row \
        + heads[:, None] * stride_c_head + dims[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                mask=mask)
    store_cache(dst, k, mask, FP8)
    store_cache(dst + stride_c_kv, v, mask, FP8)


def triton_write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into kv_cache[2, num_blocks, block_size, Hkv, D].

    Writes len(slot_mapping) rows; rows whose slot is -1 are skipped. key/value may be strided
    views (e.g. slices of a fused qkv tensor) as long as their last dim is contiguous. No host sync.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _check_shapes(key, value, kv_cache, num_tokens)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    cache, fp8 = cache_operand(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        key, value, cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def _check_shapes(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  num_tokens: int) -> None:
    """Shape/stride rules the kernel relies on; raise ValueError naming the offender."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(4) != 1:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} stride {kv_cache.stride()}: "
                         "must be [2, num_blocks, block_size, Hkv, D] with a contiguous last dim")
    expected = tuple(kv_cache.shape[3:])
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != expected or t.stride(2) != 1:
            raise ValueError(f"{name} shape {tuple(t.shape)} stride {t.stride()}: must be "
                             f"[T, {expected[0]}, {expected[1]}] with a contiguous last dim")
        if t.shape[0] < num_tokens:
            raise ValueError(f"{name} has {t.shape[0]} rows: must have >= {num_tokens} "
                             "(len(slot_mapping))")
