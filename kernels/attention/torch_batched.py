"""Vectorised torch attention: one padded gather and one SDPA call per group of requests.

The torch backend (kernels/attention/torch_ref.py) attends a pure-decode batch as one group
(`attend_decodes`) and splits any other batch into decodes (query_len 1) and prefills
(query_len > 1, chunked or not), one `attend_group` call each: mixing them would pad every
decode to the longest prefill chunk. A group of R requests, with L = its longest seq_len and
Q = its longest query_len, is padded as

    queries [R, Q, Hq, D]     row i of request r = flat row start[r] + min(i, qlen[r] - 1)
    kv      [2, R, L, Hkv, D] key/value of request r at position min(j, seq_len[r] - 1)

Padding repeats a real row, so it is always finite (never stale cache contents, which could be
NaN) and masked out: query row i of request r sits at position p = seq_len - qlen + i and sees
keys j <= p (and, with a sliding window W, j > p - W). That one causal rule is also the length
mask, since p <= seq_len - 1 for real rows.
A softcap or sinks (backend.py) cannot go through SDPA: such a group takes explicit float32 math
(scores, tanh cap, mask, softmax with the sink column), holding the [R, Hq, Q, L] scores.
Padded query rows are computed and dropped. Math is float32; attention is one
scaled_dot_product_attention call with a boolean mask and enable_gqa (query head h reads kv
head h // (Hq / Hkv)), so keys are never repeated.

Memory: a group needs 4 (2 R L Hkv D + 2 R Q Hq D) + R Q L bytes of scratch (`padded_bytes`;
SDPA's fused CPU kernel works in tiles and never holds the [R, Hq, Q, L] scores). A group above
the caller's bound is not batched (the attend_* functions return False, writing nothing) and
the caller loops over its requests instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

F32_BYTES = 4


def padded_bytes(num_reqs: int, max_query_len: int, max_seq_len: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, explicit: bool = False) -> int:
    """Scratch bytes of one padded group: float32 keys+values, queries+outputs, bool mask.
    (SDPA's fused CPU/CUDA kernels never hold the [R, Hq, Q, L] scores at once.) explicit:
    the math a softcap or sinks take, which also holds keys+values repeated to Hq heads and
    the scores and probabilities [R, Hq, Q, L]."""
    kv = 2 * num_reqs * max_seq_len * num_kv_heads * head_dim
    q_out = 2 * num_reqs * max_query_len * num_heads * head_dim
    extra = 0
    if explicit:
        extra = 2 * num_reqs * num_heads * max_seq_len * (head_dim + max_query_len)
    return F32_BYTES * (kv + q_out + extra) + num_reqs * max_query_len * max_seq_len


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores [..., Hq, Q, S]; with sinks [Hq] each head's sink
    logit is one more column of the softmax, dropped after it."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.float()[:, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def _clamped_index(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[R, width] int64: min(j, lengths[r] - 1) for j < width (lengths >= 1)."""
    cols = torch.arange(width, dtype=torch.long)
    return torch.minimum(cols[None, :], (lengths.long() - 1)[:, None])


def gather_padded_kv(kv_cache: torch.Tensor, block_rows: torch.Tensor,
                     key_pos: torch.Tensor) -> torch.Tensor:
    """Keys and values at key_pos [R, L] through block_rows [R, max_blocks]: [2, R, L, Hkv, D]
    float32, in one index_select of whole slots from the flattened cache."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_cols = -(-key_pos.shape[1] // block_size)
    # slot of every position the first num_cols blocks cover: [R, num_cols * block_size]
    offsets = torch.arange(block_size, device=block_rows.device)
    slots = (block_rows[:, :num_cols].long() * block_size)[:, :, None] + offsets
    slots = torch.gather(slots.flatten(1), 1, key_pos).flatten()
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads * head_dim)
    padded = flat.index_select(1, slots)        # far faster than flat[:, slots] on CPU
    return padded.view((2,) + tuple(key_pos.shape) + (num_kv_heads, head_dim)).float()


def attend_padded(q: torch.Tensor, kv: torch.Tensor, q_pos: torch.Tensor,
                  scale: float, window: int = 0, softcap: float = 0.0,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, Q, Hq, D] float32, kv [2, R, L, Hkv, D] float32, q_pos [R, Q] absolute positions.
    Key j is visible to query (r, i) iff j <= q_pos[r, i] (and j > q_pos[r, i] - window when
    window > 0). softcap > 0 caps the scores first; sinks [Hq] join the softmax.
    Returns [R, Q, Hq, D] float32."""
    width = kv.shape[2]
    keys = torch.arange(width, device=q.device)[None, None, :]
    visible = keys <= q_pos[:, :, None]
    if window:
        visible &= keys > q_pos[:, :, None] - window
    if softcap or sinks is not None:
        return _attend_explicit(q, kv, visible, scale, softcap, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2),
        attn_mask=visible[:, None], scale=scale, enable_gqa=True)        # [R, Hq, Q, D]
    return out.transpose(1, 2)


def _attend_explicit(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, scale: float,
                     softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """attend_padded's math step by step: scores, the cap (cap * tanh(s / cap), if any), the
    mask, the softmax with the sink column (if any)."""
    group = q.shape[2] // kv.shape[3]
    keys, values = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in kv)
    scores = torch.matmul(q.transpose(1, 2), keys.transpose(2, 3)) * scale  # [R, Hq, Q, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.matmul(softmax_with_sinks(scores, sinks), values).transpose(1, 2)


def _fits(num_reqs: int, max_query_len: int, width: int, query: torch.Tensor,
          kv_cache: torch.Tensor, max_bytes: int, explicit: bool) -> bool:
    return padded_bytes(num_reqs, max_query_len, width, query.shape[1], kv_cache.shape[3],
                        query.shape[2], explicit) <= max_bytes


def attend_decodes(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
                   max_bytes: int, window: int = 0, softcap: float = 0.0,
                   sinks: torch.Tensor | None = None) -> bool:
    """A pure-decode batch (request r's one query is flat row r) in one padded group.

    seq_lens: host [R]. Writes rows 0..R-1 of out; returns False, writing nothing, when the
    group would need more than max_bytes.
    """
    num_reqs, width = seq_lens.shape[0], int(seq_lens.max())
    explicit = bool(softcap) or sinks is not None
    if not _fits(num_reqs, 1, width, query, kv_cache, max_bytes, explicit):
        return False
    device = query.device
    kv = gather_padded_kv(kv_cache, block_table[:num_reqs],
                          _clamped_index(seq_lens, width).to(device))
    q_pos = (seq_lens.long() - 1)[:, None].to(device)                   # [R, 1]
    result = attend_padded(query[:num_reqs, None].float(), kv, q_pos, scale, window, softcap,
                           sinks)
    out[:num_reqs] = result[:, 0].to(out.dtype)
    return True


def attend_group(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 req_ids: torch.Tensor, starts: torch.Tensor, query_lens: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor, max_bytes: int,
                 window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> bool:
    """Attend requests req_ids (host int64) at once and write their rows of out [T, Hq, D].

    starts/query_lens/seq_lens: host tensors indexed by request; every query_len in the group
    is >= 1. Returns False, writing nothing, when the group would need more than max_bytes.
    """
    qlens, lens = query_lens[req_ids], seq_lens[req_ids].long()
    max_q, width = int(qlens.max()), int(lens.max())
    explicit = bool(softcap) or sinks is not None
    if not _fits(len(req_ids), max_q, width, query, kv_cache, max_bytes, explicit):
        return False
    device = query.device
    q_idx = _clamped_index(qlens, max_q)                                 # [R, Q]
    rows = starts[req_ids][:, None] + q_idx                              # flat query rows
    q_pos = (lens - qlens)[:, None] + q_idx                              # absolute positions
    kv = gather_padded_kv(kv_cache, block_table[req_ids.to(device)],
                          _clamped_index(lens, width).to(device))
    q = query.index_select(0, rows.flatten().to(device)).view(rows.shape + query.shape[1:])
    result = attend_padded(q.float(), kv, q_pos.to(device), scale, window, softcap, sinks)
    real = torch.arange(max_q)[None, :] < qlens[:, None]                 # [R, Q]
    out[rows[real].to(device)] = result[real.to(device)].to(out.dtype)
    return True
