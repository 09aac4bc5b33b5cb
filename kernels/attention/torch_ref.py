"""The torch attention backend: exact float32 math, batched by default, with a per-request loop
as the reference that other backends (and the batched path itself) test against.

Two ways to attend (layout and query/position rules: see kernels/attention/backend.py):

* per request (`batched=False`, and the fallback): loop on the host, gather each request's keys/
  values through its block table, attend. Slow (a Python loop per layer), obviously right.
* batched (default): decodes in one padded group, prefills in another (torch_batched.py): one
  index_select gather and one masked SDPA call each. A group whose padded scratch would exceed
  max_padded_bytes (256 MiB by default; torch_batched.padded_bytes) takes the per-request loop.

Both write the cache the same way first: one index_copy_ per K and V by slot mapping. A sliding
window (backend.py) is one more bound on the same mask; every key is still gathered. A softcap
(backend.py) caps the scaled scores before the mask; sinks (backend.py) join the softmax as
one more logit per head, dropped after it.
"""
from __future__ import annotations

import torch

from kernels.attention.backend import (AttentionBackend, AttentionMetadata, check_sinks,
                                       check_sliding_window, check_softcap)
from kernels.attention.torch_batched import attend_decodes, attend_group, softmax_with_sinks

DEFAULT_MAX_PADDED_BYTES = 256 * 1024 * 1024
# the one-byte caches of --kv-cache-dtype fp8 (worker_service/runner/kv_dtype.py): read by
# widening to float32 (gather_kv, torch_batched.gather_padded_kv, the CPU kernel)
FP8_CACHE_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter key/value rows [T, Hkv, D] into kv_cache[2, num_blocks, block_size, Hkv, D].

    Row t goes to flat slot slot_mapping[t] (= block * block_size + offset); rows whose slot is
    -1 (padding) are skipped. Only len(slot_mapping) rows of key/value are read. A cache whose
    value half is its key half (stride 0: MLA's latent, loader.new_kv_cache) takes the key
    tensor itself as the value and is written once; another value would overwrite the keys
    (ValueError).
    """
    one_half = kv_cache.stride(0) == 0
    if one_half and not (value.data_ptr() == key.data_ptr() and value.stride() == key.stride()
                         and value.shape == key.shape and value.dtype == key.dtype):
        raise ValueError("value is not the key tensor, but kv_cache's value half is its key "
                         "half (stride 0 on dim 0): writing it would overwrite the keys")
    num_slots = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.long)
    key, value = key[:num_slots], value[:num_slots]
    real = slots >= 0
    if not bool(real.all()):                 # host sync; padded rows are rare outside graphs
        rows = real.nonzero().squeeze(1)
        slots, key, value = slots[rows], key[rows], value[rows]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    if kv_cache.dtype in FP8_CACHE_DTYPES:     # torch has no fp8 index_copy_: copy the bytes
        flat = flat.view(torch.uint8)
    flat[0].index_copy_(0, slots, to_cache_dtype(key, kv_cache.dtype))
    if not one_half:     # else the same rows of the same tensor: written once
        flat[1].index_copy_(0, slots, to_cache_dtype(value, kv_cache.dtype))


def to_cache_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows in the cache's dtype; an fp8 cache (--kv-cache-dtype, scale 1.0) gets them rounded
    to nearest and saturated at the type's largest finite value (as vLLM's fp8 conversion),
    as bytes (uint8) for write_kv_cache's index_copy_."""
    if dtype not in FP8_CACHE_DTYPES:
        return rows.to(dtype)
    limit = torch.finfo(dtype).max
    return rows.float().clamp(-limit, limit).to(dtype).view(torch.uint8)


def gather_kv(kv_cache: torch.Tensor, block_row: torch.Tensor,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [seq_len, Hkv, D] of one request, read through its block-table row."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_row.to(torch.long)[positions // block_size]
    offsets = positions % block_size
    return kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets]


def attend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention for one request, in float32.

    query [Q, Hq, D] holds the last Q positions of a sequence whose keys/values [S, Hkv, D]
    cover all S positions; query row j sits at position p = S - Q + j and sees keys 0 .. p,
    or with window W > 0 only keys p - W + 1 .. p. softcap > 0: scores -> cap * tanh(s / cap).
    sinks [Hq]: each head's sink logit joins its softmax (transformers' GPT-OSS eager).
    """
    num_q, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    q = query.float().transpose(0, 1)                                       # [Hq, Q, D]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)        # [Hq, S, D]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)      # [Hq, S, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale                     # [Hq, Q, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(seq_len - num_q, seq_len, device=query.device)[:, None]
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    hidden = k_pos > q_pos
    if window:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.matmul(softmax_with_sinks(scores, sinks), v)                # [Hq, Q, D]
    return out.transpose(0, 1)


def attend_requests(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    req_ids: list[int], scale: float, out: torch.Tensor,
                    window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> None:
    """The reference: attend requests req_ids one by one into their rows of out."""
    starts = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens_cpu.tolist()
    for i in req_ids:
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        keys, values = gather_kv(kv_cache, meta.block_table[i], seq_lens[i])
        out[start:end] = attend_one(query[start:end], keys, values, scale,
                                    window, softcap, sinks).to(query.dtype)


class TorchAttentionBackend(AttentionBackend):
    """Torch backend: write the cache, then attend (batched, or request by request).

    batched=False always takes the per-request reference loop (use it as the reference in
    tests). max_padded_bytes bounds the scratch of one batched group (torch_batched.padded_bytes);
    a group above it takes the loop instead.
    """

    name = "torch"
    supports_sliding_window = True
    supports_softcap = True
    supports_sinks = True

    def __init__(self, batched: bool = True,
                 max_padded_bytes: int = DEFAULT_MAX_PADDED_BYTES) -> None:
        if max_padded_bytes < 0:
            raise ValueError(f"max_padded_bytes={max_padded_bytes} is invalid: must be >= 0")
        self.batched = batched
        self.max_padded_bytes = max_padded_bytes

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        # what shapes the scores, passed on together: (window, softcap, sinks)
        bounds = (check_sliding_window(sliding_window), check_softcap(softcap),
                  check_sinks(sinks, query.shape[1]))
        write_kv_cache(key, value, kv_cache, meta.slot_mapping[:meta.num_actual_tokens])
        out = torch.zeros_like(query)
        all_reqs = list(range(meta.num_reqs))
        if not self.batched or meta.num_reqs == 0:
            attend_requests(query, kv_cache, meta, all_reqs, scale, out, *bounds)
        elif meta.num_actual_tokens == meta.num_reqs and meta.max_query_len == 1:
            # pure decode: request r's one query is flat row r
            if not attend_decodes(query, kv_cache, meta.block_table,
                                  meta.seq_lens_cpu[:meta.num_reqs], scale, out,
                                  self.max_padded_bytes, *bounds):
                attend_requests(query, kv_cache, meta, all_reqs, scale, out, *bounds)
        else:
            self._attend_mixed(query, kv_cache, meta, scale, out, bounds)
        return out

    def _attend_mixed(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor, bounds: tuple) -> None:
        """Decodes as one padded group, prefills (query_len > 1) as another: mixing them would
        pad every decode to the longest prefill chunk. Requests with no query are skipped."""
        starts = meta.query_start_loc_cpu[:meta.num_reqs + 1].long()
        query_lens = starts[1:] - starts[:-1]
        seq_lens = meta.seq_lens_cpu[:meta.num_reqs]
        for req_ids in ((query_lens == 1).nonzero().squeeze(1),
                        (query_lens > 1).nonzero().squeeze(1)):
            if len(req_ids) and not attend_group(
                    query, kv_cache, meta.block_table, req_ids, starts, query_lens, seq_lens,
                    scale, out, self.max_padded_bytes, *bounds):
                attend_requests(query, kv_cache, meta, req_ids.tolist(), scale, out, *bounds)
