"""Triton paged attention over kv_cache[2, num_blocks, block_size, Hkv, D] (see backend.py).

Two launch shapes share one inner loop (`_attend_range`, online softmax in base 2, fp32 m/l/acc;
triton_attend.py). This module launches them; the kernels live in triton_prefill_kernel.py and
triton_decode_kernels.py:

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

from kernels.attention.triton_decode_kernels import _decode_kernel, _reduce_kernel
from kernels.attention.triton_fp8 import cache_operand
from kernels.attention.triton_launch import (  # noqa: F401  (re-exported names)
    MAX_SPLITS, MIN_DOT_ROWS, MIN_SPLIT_TOKENS, TritonLaunchConfig, choose_num_splits,
    decode_keys_per_step, decode_tile_shape, prefill_tile_shape)
from kernels.attention.triton_prefill_kernel import _prefill_kernel

LOG2E = 1.4426950408889634

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
    cache, fp8 = cache_operand(kv_cache)
    shape = prefill_tile_shape(launch, group, query.shape[2], _read_bytes(query, kv_cache),
                               block_q_rows)
    tiles = shape.tiles
    grid = (triton.cdiv(num_tokens, shape.block_q) + num_reqs, kv_cache.shape[3] * shape.g_tiles)
    _prefill_kernel[grid](
        query, out, cache, block_table, query_start_loc, seq_lens, num_reqs,
        scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), *kv_cache.stride()[:4], window, softcap * LOG2E,
        _log2_sinks(sinks, seq_lens),
        GROUP=group, HEAD_DIM=query.shape[2], BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=shape.block_q, BLOCK_G=shape.block_g, BLOCK_D=shape.block_d,
        BLOCK_N=block_n or tiles.block_n,
        **_dot_params(query), SKIP_DECODES=skip_decodes, SLIDING=window > 0,
        SOFTCAP=softcap > 0, SINKS=sinks is not None, G_TILES=shape.g_tiles,
        KV_SHARED=kv_cache.stride(0) == 0, FP8=fp8,
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
    cache, fp8 = cache_operand(kv_cache)
    shape = decode_tile_shape(launch, group, query.shape[2], _read_bytes(query, kv_cache),
                              block_n)
    tiles = shape.tiles
    num_heads, head_dim = query.shape[1], query.shape[2]
    partials = num_splits > 1
    part_shape = (num_reqs, num_heads, num_splits) if partials else (1, 1, 1)
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
        query, out, m, l, acc, cache, block_table, query_start_loc, seq_lens,
        order if ordered else seq_lens, num_splits, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        *kv_cache.stride()[:4], window, softcap * LOG2E, log2_sinks,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2],
        PARTIALS=partials, BLOCK_G=shape.block_g, BLOCK_D=shape.block_d,
        BLOCK_N=tiles.block_n,
        **_dot_params(query), HEAD_FASTEST=head_fastest, ORDERED=ordered, SLIDING=window > 0,
        SOFTCAP=softcap > 0, SINKS=sinks is not None and not partials, G_TILES=shape.g_tiles,
        KV_SHARED=kv_cache.stride(0) == 0, FP8=fp8, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages)
    if partials:
        _reduce_kernel[(num_reqs, num_heads)](
            out, m, l, acc, query_start_loc, num_splits, out.stride(0), out.stride(1),
            log2_sinks, NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=shape.block_d,
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


def _read_bytes(query: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """Bytes of a cache element as the dots read it: an fp8 cache's codes widen to the
    query's dtype, so its tiles are sized as a model-dtype cache's."""
    return query.element_size() if cache_operand(kv_cache)[1] else kv_cache.element_size()


def _dot_params(query: torch.Tensor) -> dict:
    """PRECISION: fp32 inputs keep full-precision dots (fp16/bf16 dots accumulate in fp32
    anyway). UPCAST: the CPU interpreter cannot tl.dot bf16, so there operands go to fp32."""
    upcast = query.device.type == "cpu" and query.dtype == torch.bfloat16
    full = upcast or query.dtype == torch.float32
    return {"PRECISION": "ieee" if full else "tf32", "UPCAST": upcast}
