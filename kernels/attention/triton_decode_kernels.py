"""The split-KV flash-decoding Triton kernels: the decode kernel, one program per (request, kv
head tile, split), and the reduce kernel that merges a request's splits; triton_paged_attention.py
draws the design and launches them (paged_decode_attention)."""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention.triton_attend import NEG_BIG, _attend_range, _head_tile, _normalize


@triton.jit
def _split_keys(keys, num_splits, BLOCK_N: tl.constexpr, PARTIALS: tl.constexpr):
    """Keys per split, whole BLOCK_N steps: all of them without PARTIALS (one split), so that
    launch compiles as it did with the split count a constexpr 1 (no division)."""
    if PARTIALS:
        keys = tl.cdiv(keys, num_splits)
    return tl.cdiv(keys, BLOCK_N) * BLOCK_N


# Arguments that move with the batch, unspecialised (Triton compiles again for an int that turns
# 1 or a multiple of 16): the block table's row stride, and the split count. That is a runtime
# argument, not a constexpr: the heuristic (choose_num_splits) picks any count up to max_splits
# as the batch moves, and eager decode compiled the pair anew for each one. It costs one division
# per program, outside the key loop; PARTIALS (num_splits > 1) is the only split constexpr, so a
# model compiles two decode variants and one reduce (docs/gpu.md).
DECODE_VARYING = ["stride_bt", "num_splits"]


@triton.jit(do_not_specialize=DECODE_VARYING)
def _decode_kernel(q_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cache_ptr, bt_ptr, qsl_ptr,
                   seq_lens_ptr, order_ptr, num_splits, qk_scale, stride_qt, stride_qh, stride_ot,
                   stride_oh, stride_bt, stride_c_kv, stride_c_blk, stride_c_row, stride_c_head,
                   window, softcap, sinks_ptr,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, PARTIALS: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, HEAD_FASTEST: tl.constexpr, ORDERED: tl.constexpr,
                   SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
                   G_TILES: tl.constexpr, KV_SHARED: tl.constexpr, FP8: tl.constexpr):
    if HEAD_FASTEST:       # grid (Hkv * G_TILES, num_reqs, splits): a request's heads together
        kv_head, g_first = _head_tile(tl.program_id(0), G_TILES, BLOCK_G)
        req = tl.program_id(1)
        if ORDERED:        # the rank-th longest request (order_ptr: int64 [num_reqs])
            req = tl.load(order_ptr + req).to(tl.int32)
    else:                  # grid (num_reqs, Hkv * G_TILES, splits)
        req = tl.program_id(0)
        kv_head, g_first = _head_tile(tl.program_id(1), G_TILES, BLOCK_G)
    split = tl.program_id(2)
    q_index = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) - q_index != 1:    # padding, or a prefill (not ours)
        return
    seq_len = tl.load(seq_lens_ptr + req)
    if SLIDING:            # the splits share the last `window` keys, all visible to the query
        lo = tl.maximum(seq_len - window, 0)
        chunk = _split_keys(seq_len - lo, num_splits, BLOCK_N, PARTIALS)
        start = lo + split * chunk
    else:
        chunk = _split_keys(seq_len, num_splits, BLOCK_N, PARTIALS)
        start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    group_idx = g_first + tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + group_idx
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    io_mask = (group_idx < GROUP)[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_index.to(tl.int64) * stride_qt + head[:, None] * stride_qh
                + dims[None, :], mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tl.full([BLOCK_G], 0, tl.int32) + seq_len - 1
    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_c_head
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos,
                                  start, full_end, end, stride_c_kv, stride_c_blk, stride_c_row,
                                  dims, dim_ok, qk_scale, window, softcap, BLOCK_SIZE, BLOCK_N,
                                  False, PRECISION, UPCAST, False, SOFTCAP, KV_SHARED, FP8)
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos,
                                  full_end, end, end, stride_c_kv, stride_c_blk, stride_c_row,
                                  dims, dim_ok, qk_scale, window, softcap, BLOCK_SIZE, BLOCK_N,
                                  True, PRECISION, UPCAST, False, SOFTCAP, KV_SHARED, FP8)
    if not PARTIALS:
        out = _normalize(acc, m_i, l_i, sinks_ptr, head, group_idx < GROUP, SINKS)
        tl.store(out_ptr + q_index.to(tl.int64) * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials: m, l [num_reqs, NUM_HEADS, num_splits]; acc [..., HEAD_DIM], all fp32
        part = (req.to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(m_ptr + part, m_i, mask=group_idx < GROUP)
        tl.store(l_ptr + part, l_i, mask=group_idx < GROUP)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=io_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, qsl_ptr, num_splits, stride_ot, stride_oh,
                   sinks_ptr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """Merge a request's num_splits partials of one head, one split a step (a runtime loop, so
    no split count is compiled in, and one head row of registers at any count: a [splits, D]
    tile of MLA's 1024-wide rows would not fit one warp's registers)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_index = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) - q_index != 1:
        return
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    first = (req.to(tl.int64) * NUM_HEADS + head) * num_splits
    m = tl.load(m_ptr + first)
    l = tl.load(l_ptr + first)
    acc = tl.load(acc_ptr + first * HEAD_DIM + dims, mask=dim_ok, other=0.0)
    for split in range(1, num_splits):     # online merge; an empty split: m NEG_BIG, l 0, acc 0
        m_s = tl.load(m_ptr + first + split)
        top = tl.maximum(m, m_s)
        keep = tl.exp2(m - top)
        weight = tl.exp2(m_s - top)
        l = l * keep + tl.load(l_ptr + first + split) * weight
        acc = acc * keep + tl.load(acc_ptr + (first + split) * HEAD_DIM + dims, mask=dim_ok,
                                   other=0.0) * weight
        m = top
    if SINKS:              # the sink is one more term of the merged denominator
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(m, sink)
        keep = tl.exp2(m - top)
        acc = acc * keep
        l = l * keep + tl.exp2(sink - top)
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + q_index.to(tl.int64) * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)
