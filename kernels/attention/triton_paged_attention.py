"""Triton paged attention over kv_cache[2, num_blocks, block_size, Hkv, D] (see backend.py).

Two launch shapes share one inner loop (`_attend_range`, online softmax in base 2, fp32 m/l/acc):

* `paged_prefill_attention`: varlen queries (prefill, chunked prefill, decodes mixed in). One
  program per (query tile, kv head). A tile is BLOCK_Q query tokens x the GROUP query heads that
  share the kv head, flattened into BLOCK_Q * BLOCK_G rows of one tl.dot, so each K/V tile loaded
  from the cache serves the whole GQA group. Keys before the tile's first query position are
  visible to every row and run unmasked; only the diagonal tiles apply the causal mask.
* `paged_decode_attention` (flash-decoding): one query token per request. One program per
  (request, kv head, split); each split walks a 1/num_splits share of the request's context and
  writes partial (m, l, acc); `_reduce_kernel` merges the splits. num_splits == 1 writes directly.

Why two launch shapes rather than one unified kernel: a decode row has one token, so a prefill
tile (BLOCK_Q tokens) would be mostly empty, and decode parallelism must come from splitting the
context because (requests x kv heads) alone can leave most SMs idle at small batch; prefill has
plenty of parallelism from its query tiles and would only pay the partial-result round trip.
Which kernel serves which requests is the backend's `dispatch` (triton_launch.py): by batch (the
default), always the varlen kernel (unified), or per request (a mixed batch makes both launches;
the varlen kernel then skips one-token requests, SKIP_DECODES, and the decode kernel skips every
request whose query is not exactly one token). `python -m bench.attention_bandwidth --unified /
--mixed / --sweep` times the designs and the launch choices on a GPU (issue 5).

Sliding window W (SLIDING, a constexpr: off compiles today's kernels unchanged; window is the
runtime W): a query at position p sees keys p - W < k <= p. The varlen kernel starts a tile at
the first key its earliest row sees, masks the keys below its latest row's window (as it masks
the diagonal) and runs the keys every row sees unmasked; the decode kernel splits only the last
W keys, which its one query sees whole, so it needs no mask of its own.

Attention sinks (SINKS, a constexpr; GPT-OSS): a per-query-head logit, passed in log2 units
(sinks * log2(e)), that joins each row's softmax denominator when the row is normalised
(`_normalize`; in the split decode, `_reduce_kernel` adds it once over the merged splits). Off,
the kernels compile as before apart from the unused pointer argument.

Wide heads (a head padded to triton_launch.WIDE_HEAD_DIM or more: DeepSeek's MLA latent, 576
-> 1024) take smaller tiles so both kernels fit sm_90's shared memory (triton_launch.py): a GQA
group above wide_tile_rows heads is cut into G_TILES tiles, each its own program (grid axis of
the kv heads times G_TILES; G_TILES == 1 compiles as before). KV_SHARED (a constexpr: the
cache's value half is its key half, stride 0, as MLA's) reads each key tile once as K and V.

Tiles map to requests without a host sync: request i owns tiles starting at
qsl[i] // BLOCK_Q + i, so cdiv(num_tokens, BLOCK_Q) + num_reqs programs always suffice and
each finds its request by binary search over query_start_loc.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.triton_launch import (  # noqa: F401  (re-exported names)
    MAX_SPLITS, MIN_DOT_ROWS, MIN_SPLIT_TOKENS, TritonLaunchConfig, choose_num_splits,
    decode_keys_per_step, decode_tile_shape, prefill_tile_shape)

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)   # finite "minus infinity" for m: masked rows never make NaNs


@triton.jit
def _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos, start, end, kv_limit,
                  stride_c_kv, stride_c_blk, stride_c_row, dims, dim_ok, qk_scale, window,
                  softcap, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, SLIDING: tl.constexpr,
                  SOFTCAP: tl.constexpr, KV_SHARED: tl.constexpr):
    """Fold keys [start, end) into (m_i, l_i, acc). Keys are read through the block table;
    MASKED applies key <= q_pos and key < kv_limit (and with SLIDING key > q_pos - window),
    else every key in range must be visible. SOFTCAP: scores -> cap * tanh(scores / cap) before
    the mask (softcap is cap * log2(e), since s is in log2 units). KV_SHARED: the cache's value
    half is its key half (stride 0: MLA's latent), so one load and one tile serve as both."""
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
        if UPCAST:
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
                    KV_SHARED: tl.constexpr):
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
                                      KV_SHARED)
    else:
        full_lo = 0
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos,
                                  full_lo, unmasked_end, kv_end, stride_c_kv, stride_c_blk,
                                  stride_c_row, dims, dim_ok, qk_scale, window, softcap,
                                  BLOCK_SIZE, BLOCK_N, False, PRECISION, UPCAST, False, SOFTCAP,
                                  KV_SHARED)
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos,
                                  unmasked_end, kv_end, kv_end, stride_c_kv, stride_c_blk,
                                  stride_c_row, dims, dim_ok, qk_scale, window, softcap,
                                  BLOCK_SIZE, BLOCK_N, True, PRECISION, UPCAST, SLIDING, SOFTCAP,
                                  KV_SHARED)
    out = _normalize(acc, m_i, l_i, sinks_ptr, head, row_ok, SINKS)
    tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(q_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cache_ptr, bt_ptr, qsl_ptr,
                   seq_lens_ptr, order_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_c_kv, stride_c_blk, stride_c_row, stride_c_head, window, softcap,
                   sinks_ptr, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, HEAD_FASTEST: tl.constexpr, ORDERED: tl.constexpr,
                   SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
                   G_TILES: tl.constexpr, KV_SHARED: tl.constexpr):
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
        chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
    else:
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
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
                                  False, PRECISION, UPCAST, False, SOFTCAP, KV_SHARED)
    m_i, l_i, acc = _attend_range(q, m_i, l_i, acc, cache_ptr, bt_row_ptr, head_off, q_pos,
                                  full_end, end, end, stride_c_kv, stride_c_blk, stride_c_row,
                                  dims, dim_ok, qk_scale, window, softcap, BLOCK_SIZE, BLOCK_N,
                                  True, PRECISION, UPCAST, False, SOFTCAP, KV_SHARED)
    if NUM_SPLITS == 1:
        out = _normalize(acc, m_i, l_i, sinks_ptr, head, group_idx < GROUP, SINKS)
        tl.store(out_ptr + q_index.to(tl.int64) * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials: m, l [num_reqs, NUM_HEADS, NUM_SPLITS]; acc [..., HEAD_DIM], all fp32
        part = (req.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(m_ptr + part, m_i, mask=group_idx < GROUP)
        tl.store(l_ptr + part, l_i, mask=group_idx < GROUP)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=io_mask)


@triton.jit
def _reduce_kernel(out_ptr, m_ptr, l_ptr, acc_ptr, qsl_ptr, stride_ot, stride_oh, sinks_ptr,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_index = tl.load(qsl_ptr + req)
    if tl.load(qsl_ptr + req + 1) - q_index != 1:
        return
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_D)
    part = (req.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(m_ptr + part, mask=split_ok, other=NEG_BIG)
    l = tl.load(l_ptr + part, mask=split_ok, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    if SINKS:              # the sink is one more term of the merged denominator
        sink = tl.load(sinks_ptr + head)
        top = tl.maximum(tl.max(m, 0), sink)
        weight = tl.exp2(m - top)                        # empty splits: l = 0, acc = 0
        total = tl.sum(weight * l, 0) + tl.exp2(sink - top)
    else:
        weight = tl.exp2(m - tl.max(m, 0))               # empty splits: l = 0, acc = 0
        total = tl.sum(weight * l, 0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_index.to(tl.int64) * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, num_reqs: int, num_tokens: int,
                            scale: float, block_q_rows: int | None = None,
                            block_n: int | None = None, launch: TritonLaunchConfig | None = None,
                            skip_decodes: bool = False, window: int = 0,
                            softcap: float = 0.0, sinks: torch.Tensor | None = None) -> None:
    """Varlen causal attention with cached prefixes into out[:num_tokens] (no host sync).

    query/out [T, Hq, D] (last dim contiguous); query_start_loc int32 [num_reqs + 1];
    seq_lens int32 [num_reqs]; block_table int32 [num_reqs, max_blocks]. block_q_rows (tile
    height in (token, query head) rows) and block_n (keys per inner step) override `launch`'s
    block_q_rows and prefill.block_n. skip_decodes leaves one-token requests' rows of out
    untouched (paged_decode_attention writes them). window: the sliding window W (0: none).
    softcap: cap > 0 caps every score to cap * tanh(score / cap) (Gemma 2); 0: none.
    sinks: float32 [Hq] sink logits (GPT-OSS; backend.py); None: none.
    """
    if num_reqs == 0 or num_tokens == 0:
        return
    launch = launch or TritonLaunchConfig()
    group = _check_shapes(query, kv_cache)
    shape = prefill_tile_shape(launch, group, query.shape[2], kv_cache.element_size(),
                               block_q_rows)
    tiles = shape.tiles
    grid = (triton.cdiv(num_tokens, shape.block_q) + num_reqs, kv_cache.shape[3] * shape.g_tiles)
    _prefill_kernel[grid](
        query, out, kv_cache, block_table, query_start_loc, seq_lens, num_reqs,
        scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), *kv_cache.stride()[:4], window, softcap * LOG2E,
        _log2_sinks(sinks, seq_lens),
        GROUP=group, HEAD_DIM=query.shape[2], BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=shape.block_q, BLOCK_G=shape.block_g, BLOCK_D=shape.block_d,
        BLOCK_N=block_n or tiles.block_n,
        **_dot_params(query), SKIP_DECODES=skip_decodes, SLIDING=window > 0,
        SOFTCAP=softcap > 0, SINKS=sinks is not None, G_TILES=shape.g_tiles,
        KV_SHARED=kv_cache.stride(0) == 0,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _log2_sinks(sinks: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """The sink logits in the kernels' log2 units, or (no sinks) a tensor the kernel never
    reads, so the launch keeps one signature."""
    return stand_in if sinks is None else (sinks.float() * LOG2E).contiguous()


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, num_reqs: int, num_splits: int,
                           scale: float, block_n: int | None = None,
                           launch: TritonLaunchConfig | None = None,
                           order: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> None:
    """Attention for the requests with exactly one query token (flash-decoding).

    Same tensors as paged_prefill_attention. Each request's context is cut into num_splits
    parts (any num_splits >= 1 is correct for any seq_len, so a CUDA graph may fix it).
    Requests whose query is not one token (padding, prefills) are skipped: their rows of out
    are left untouched. block_n overrides launch.decode.block_n; either is capped by
    decode_keys_per_step (fp32 or head_dim 256 read fewer keys a step). `order` (int64
    [num_reqs], a permutation: AttentionMetadata.decode_order) is the start order of the
    requests under decode_order="longest_first"; without it that order runs as head_fastest.
    window: the sliding window W (0: none); the splits then share only the last W keys.
    """
    if num_reqs == 0:
        return
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} is invalid: must be >= 1")
    launch = launch or TritonLaunchConfig()
    group = _check_shapes(query, kv_cache)
    shape = decode_tile_shape(launch, group, query.shape[2], kv_cache.element_size(), block_n)
    tiles = shape.tiles
    num_heads, head_dim = query.shape[1], query.shape[2]
    part_shape = (num_reqs, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    m = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    l = torch.empty(part_shape, dtype=torch.float32, device=query.device)
    acc = torch.empty(part_shape + (head_dim,), dtype=torch.float32, device=query.device)
    log2_sinks = _log2_sinks(sinks, seq_lens)
    head_fastest = launch.decode_order != "request_fastest"
    ordered = launch.decode_order == "longest_first" and order is not None
    head_programs = kv_cache.shape[3] * shape.g_tiles
    grid = ((head_programs, num_reqs) if head_fastest else (num_reqs, head_programs)) \
        + (num_splits,)
    _decode_kernel[grid](
        query, out, m, l, acc, kv_cache, block_table, query_start_loc, seq_lens,
        order if ordered else seq_lens, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        *kv_cache.stride()[:4], window, softcap * LOG2E, log2_sinks,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2],
        NUM_SPLITS=num_splits, BLOCK_G=shape.block_g, BLOCK_D=shape.block_d,
        BLOCK_N=tiles.block_n,
        **_dot_params(query), HEAD_FASTEST=head_fastest, ORDERED=ordered, SLIDING=window > 0,
        SOFTCAP=softcap > 0, SINKS=sinks is not None and num_splits == 1, G_TILES=shape.g_tiles,
        KV_SHARED=kv_cache.stride(0) == 0, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if num_splits > 1:
        _reduce_kernel[(num_reqs, num_heads)](
            out, m, l, acc, query_start_loc, out.stride(0), out.stride(1), log2_sinks,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=shape.block_d,
            SINKS=sinks is not None, num_warps=1)


def _check_shapes(query: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """The GQA group (query heads per kv head), after checking query against the cache."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query heads/dim {num_heads}/{head_dim} do not fit kv_cache "
                         f"{tuple(kv_cache.shape)}: Hq must be a multiple of Hkv, D must match")
    if query.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("query and kv_cache must have a contiguous last (head_dim) dim")
    return num_heads // num_kv_heads


def _dot_params(query: torch.Tensor) -> dict:
    """PRECISION: fp32 inputs keep full-precision dots (fp16/bf16 dots accumulate in fp32
    anyway). UPCAST: the CPU interpreter cannot tl.dot bf16, so there operands go to fp32."""
    upcast = query.device.type == "cpu" and query.dtype == torch.bfloat16
    full = upcast or query.dtype == torch.float32
    return {"PRECISION": "ieee" if full else "tf32", "UPCAST": upcast}
