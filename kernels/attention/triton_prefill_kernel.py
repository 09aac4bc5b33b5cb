"""The varlen ("prefill") Triton attention kernel: one program per (query tile, kv head tile);
triton_paged_attention.py draws the design and launches it (paged_prefill_attention)."""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention.triton_attend import (NEG_BIG, _attend_range, _find_request, _head_tile,
                                             _normalize)


# Triton compiles one variant per integer-argument pattern (== 1, divisible by 16, other). The
# request count and the block table's row stride (the step's longest request, in blocks) change
# from step to step, so specialising on them compiled the varlen kernel anew in mid-run: 0.91 s
# of one H100 run's 10.8 s (bench/results.md). Neither gains from it.
STEP_VARYING = ["num_reqs", "stride_bt"]


@triton.jit(do_not_specialize=STEP_VARYING)
def _prefill_kernel(q_ptr, out_ptr, cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, num_reqs, qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_c_kv, stride_c_blk, stride_c_row, stride_c_head, window, softcap,
                    sinks_ptr,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    SKIP_DECODES: tl.constexpr, SLIDING: tl.constexpr,
                    SOFTCAP: tl.constexpr, SINKS: tl.constexpr, G_TILES: tl.constexpr,
                    KV_SHARED: tl.constexpr, FP8: tl.constexpr):
    tile = tl.program_id(0)
    kv_head, g_first = _head_tile(tl.program_id(1), G_TILES, BLOCK_G)
    req = _find_request(qsl_ptr, num_reqs, tile, BLOCK_Q)
    q_begin = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_begin
    q_first = (tile - q_begin // BLOCK_Q - req) * BLOCK_Q     # first query index of this tile
    done = q_first >= q_len
    if SKIP_DECODES:                     # one-token requests belong to the decode kernel
        done = done | (q_len == 1)
    if done:
        return
    context_len = tl.load(seq_lens_ptr + req) - q_len          # cached keys before the queries
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)                      # row = token * BLOCK_G + g
    tok = q_first + rows // BLOCK_G
    group_idx = g_first + rows % BLOCK_G
    row_ok = (tok < q_len) & (group_idx < GROUP)
    head = kv_head * GROUP + group_idx
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]
    tok64 = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context_len + tok
    m_i = tl.full([BLOCK_Q * BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_c_head
    first_pos = context_len + q_first                       # every row sees keys < first_pos
    kv_end = context_len + tl.minimum(q_first + BLOCK_Q, q_len)
    unmasked_end = first_pos // BLOCK_N * BLOCK_N
    if SLIDING:
        # keys below the first row's window are skipped; [lo, full_lo) holds the keys below
        # some row's window (masked); every row sees the keys from full_lo to unmasked_end
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N) * BLOCK_N,
                             unmasked_end)
        m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos,
                                      lo, full_lo, full_lo, stride_c_kv, stride_c_blk,
                                      stride_c_row, dims, dim_ok, qk_scale, window, softcap,
                                      BLOCK_SIZE, BLOCK_N, True, PRECISION, UPCAST, True, SOFTCAP,
                                      KV_SHARED, FP8)
    else:
        full_lo = 0
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos,
                                  full_lo, unmasked_end, kv_end, stride_c_kv, stride_c_blk,
                                  stride_c_row, dims, dim_ok, qk_scale, window, softcap,
                                  BLOCK_SIZE, BLOCK_N, False, PRECISION, UPCAST, False, SOFTCAP,
                                  KV_SHARED, FP8)
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos,
                                  unmasked_end, kv_end, kv_end, stride_c_kv, stride_c_blk,
                                  stride_c_row, dims, dim_ok, qk_scale, window, softcap,
                                  BLOCK_SIZE, BLOCK_N, True, PRECISION, UPCAST, SLIDING, SOFTCAP,
                                  KV_SHARED, FP8)
    out = _normalize(acc, m_i, l_i, sinks_ptr, head, row_ok, SINKS)
    tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)
