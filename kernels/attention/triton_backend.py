"""The Triton attention backend: KV write kernel, then paged prefill or flash-decoding attention.

On CPU the kernels run only under the Triton interpreter: TRITON_INTERPRET=1 must be set before
this module (or the kernel modules) is first imported, because @triton.jit reads it then.
"""
from __future__ import annotations

import torch

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from kernels.attention.triton_cache import triton_write_kv_cache
from kernels.attention.triton_paged_attention import (
    choose_num_splits, paged_decode_attention, paged_prefill_attention)

CPU_NUM_SMS = 4      # stand-in SM count for the interpreter (keeps split counts small)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton. A batch whose max_query_len is 1 is all decode and takes the
    split-KV path; any other batch (prefill, chunked prefill, mixed) takes the varlen path.

    `decode_splits` fixes the decode split count (e.g. for CUDA graph capture); None chooses it
    per step from the batch shape and max_seq_len.
    """

    name = "triton"

    def __init__(self, decode_splits: int | None = None) -> None:
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits={decode_splits} is invalid: must be >= 1 or None")
        self.decode_splits = decode_splits
        self._num_sms: dict[torch.device, int] = {}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        triton_write_kv_cache(key, value, kv_cache, meta.slot_mapping[:num_tokens])
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if meta.max_query_len == 1:
            splits = self.decode_splits or choose_num_splits(
                meta.num_reqs, kv_cache.shape[3], meta.max_seq_len, self._sms(query.device))
            paged_decode_attention(query, kv_cache, out, meta.query_start_loc, meta.seq_lens,
                                   meta.block_table, meta.num_reqs, splits, scale)
        else:
            paged_prefill_attention(query, kv_cache, out, meta.query_start_loc, meta.seq_lens,
                                    meta.block_table, meta.num_reqs, num_tokens, scale)
        return out

    def _sms(self, device: torch.device) -> int:
        """Streaming multiprocessors on `device`, asked once per device."""
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda" else CPU_NUM_SMS)
        return self._num_sms[device]
