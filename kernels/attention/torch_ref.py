"""The torch reference attention backend: slow, simple, exact. Other backends test against it.

It loops over requests on the host, gathers each request's keys/values through its block table
and attends in float32 (layout and query/position rules: see kernels/attention/backend.py).
"""
from __future__ import annotations

import torch

from kernels.attention.backend import AttentionBackend, AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter key/value rows [T, Hkv, D] into kv_cache[2, num_blocks, block_size, Hkv, D].

    Row t goes to flat slot slot_mapping[t] (= block * block_size + offset); rows whose slot is
    -1 (padding) are skipped. Only len(slot_mapping) rows of key/value are read.
    """
    num_slots = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.long)
    real = slots >= 0
    slots = slots[real]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0, slots] = key[:num_slots][real].to(kv_cache.dtype)
    flat[1, slots] = value[:num_slots][real].to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_row: torch.Tensor,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [seq_len, Hkv, D] of one request, read through its block-table row."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_row.to(torch.long)[positions // block_size]
    offsets = positions % block_size
    return kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets]


def attend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scale: float) -> torch.Tensor:
    """Causal GQA attention for one request, in float32.

    query [Q, Hq, D] holds the last Q positions of a sequence whose keys/values [S, Hkv, D]
    cover all S positions; query row j sits at position S - Q + j and sees keys 0 .. S - Q + j.
    """
    num_q, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)                                       # [Hq, Q, D]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)        # [Hq, S, D]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)      # [Hq, S, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale                     # [Hq, Q, S]
    q_pos = torch.arange(seq_len - num_q, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)                    # [Hq, Q, D]
    return out.transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    """Reference backend: write the cache, then attend request by request."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        write_kv_cache(key, value, kv_cache, meta.slot_mapping[:num_tokens])
        out = torch.zeros_like(query)
        starts = meta.query_start_loc_cpu.tolist()
        seq_lens = meta.seq_lens_cpu.tolist()
        for i in range(meta.num_reqs):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            keys, values = gather_kv(kv_cache, meta.block_table[i], seq_lens[i])
            out[start:end] = attend_one(query[start:end], keys, values, scale).to(query.dtype)
        return out
