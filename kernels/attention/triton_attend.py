"""Device functions both Triton attention kernels share (triton_paged_attention.py draws the
design): the online-softmax inner loop over a range of keys read through the block table, the
row normalisation (with attention sinks), and the maps from program ids to kv heads and requests.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention.triton_fp8 import decode

NEG_BIG = tl.constexpr(-1.0e30)   # finite "minus infinity" for m: masked rows never make NaNs


@triton.jit
def _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos, start, end, kv_limit,
                  stride_c_kv, stride_c_blk, stride_c_row, dims, dim_ok, qk_scale, window,
                  softcap, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, SLIDING: tl.constexpr,
                  SOFTCAP: tl.constexpr, KV_SHARED: tl.constexpr, FP8: tl.constexpr):
    """Fold keys [start, end) into (m_i, l_i, acc). Keys are read through the block table;
    MASKED applies key <= q_pos and key < kv_limit (and with SLIDING key > q_pos - window),
    else every key in range must be visible. SOFTCAP: scores -> cap * tanh(scores / cap) before
    the mask (softcap is cap * log2(e), since s is in log2 units). KV_SHARED: the cache's value
    half is its key half (stride 0: MLA's latent), so one load and one tile serve as both.
    FP8 (triton_fp8.py): the cache holds fp8 codes (uint8), widened to q's dtype as they are
    read: exact, so the dots are those of a model-dtype cache holding the rounded values."""
    for kv_start in range(start, end, BLOCK_N):
        kpos = kv_start + tl.arange(0, BLOCK_N)
        in_range = kpos < kv_limit
        blk = tl.load(bt_row_ptr + kpos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        row_off = blk * stride_c_blk + (kpos % BLOCK_SIZE) * stride_c_row + head_off
        kv_mask = in_range[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + row_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if KV_SHARED:
            v = k
        else:
            v = tl.load(cache_ptr + stride_c_kv + row_off[:, None] + dims[None, :],
                        mask=kv_mask, other=0.0)
        if FP8 != 0:
            k = decode(k, FP8).to(q.dtype)
            v = decode(v, FP8).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale     # [M, N] fp32
        if SOFTCAP:        # tanh from exp(-2|y|) <= 1: no overflow at either end
            e = tl.exp(tl.abs(s) * (-2.0 / softcap))
            s = softcap * tl.where(s < 0, e - 1.0, 1.0 - e) / (1.0 + e)
        if MASKED:
            visible = (kpos[None, :] <= q_pos[:, None]) & in_range[None, :]
            if SLIDING:
                visible = visible & (kpos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _normalize(acc, m_i, l_i, sinks_ptr, head, row_ok, SINKS: tl.constexpr):
    """acc / l, or with sinks acc / (l + 2^(sink - m)) computed against max(m, sink) so that
    neither power overflows (rows with no key: 0)."""
    if SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
        top = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - top)
        return acc * (keep / (l_i * keep + tl.exp2(sink - top)))[:, None]
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


@triton.jit
def _head_tile(pid, G_TILES: tl.constexpr, BLOCK_G: tl.constexpr):
    """(kv head, first query head of the tile within its group) of program id `pid` when each
    kv head's GROUP query heads are cut into G_TILES tiles of BLOCK_G (1: one tile, pid)."""
    if G_TILES == 1:
        kv_head = pid
        g_first = pid * 0
    else:
        kv_head = pid // G_TILES
        g_first = pid % G_TILES * BLOCK_G
    return kv_head, g_first


@triton.jit
def _find_request(qsl_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The request owning query tile `tile`: the last i with qsl[i] // BLOCK_Q + i <= tile."""
    lo = tile * 0
    hi = num_reqs + tile * 0
    while lo < hi:
        mid = (lo + hi) // 2
        owns_from = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(owns_from <= tile, mid + 1, lo)
        hi = tl.where(owns_from <= tile, hi, mid)
    return lo - 1
