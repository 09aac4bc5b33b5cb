"""The Triton attention backend: KV write kernel, then paged prefill or flash-decoding attention.

On CPU the kernels run only under the Triton interpreter: TRITON_INTERPRET=1 must be set before
this module (or the kernel modules) is first imported, because @triton.jit reads it then.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kernels.attention.backend import (AttentionBackend, AttentionMetadata, check_sinks,
                                       check_sliding_window, check_softcap)
from kernels.attention.triton_cache import triton_write_kv_cache
from kernels.attention.triton_launch import TritonLaunchConfig, decode_tile_shape
from kernels.attention.triton_paged_attention import (
    paged_decode_attention, paged_prefill_attention)

CPU_NUM_SMS = 4      # stand-in SM count for the interpreter (keeps split counts small)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton. By default (dispatch "by_batch") a batch whose max_query_len
    is 1 is all decode and takes the split-KV path; any other batch (prefill, chunked prefill,
    mixed) takes the varlen path. `launch.dispatch` picks the other designs (triton_launch.py).

    `decode_splits` fixes the decode split count (e.g. for CUDA graph capture) and overrides
    launch.decode_splits; None leaves it to `launch` (by default chosen per step from the batch
    shape and max_seq_len).
    """

    name = "triton"
    writes_kv_from_rope = True
    supports_sliding_window = True
    supports_softcap = True
    supports_sinks = True

    def __init__(self, decode_splits: int | None = None,
                 launch: TritonLaunchConfig | None = None) -> None:
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits={decode_splits} is invalid: must be >= 1 or None")
        launch = launch or TritonLaunchConfig()
        if decode_splits is not None:
            launch = replace(launch, decode_splits=decode_splits)
        self.launch = launch
        self._num_sms: dict[torch.device, int] = {}

    @property
    def decode_splits(self) -> int | None:
        """The fixed decode split count, or None when the heuristic chooses per step."""
        return self.launch.decode_splits

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_written: bool = False, sliding_window: int = 0,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """kv_written: the fused rope already stored this call's keys/values (same slots,
        same bound), so the write launch is skipped. sliding_window: W > 0 attends to the last
        W positions only (backend.py). softcap: cap > 0 caps the scores (backend.py). sinks:
        [Hq] logits joining each softmax's denominator (backend.py)."""
        window = check_sliding_window(sliding_window)
        cap = check_softcap(softcap)
        sinks = check_sinks(sinks, query.shape[1])
        if not kv_written:
            triton_write_kv_cache(key, value, kv_cache,
                                  meta.slot_mapping[:meta.num_actual_tokens])
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        dispatch = self.launch.dispatch
        all_decode = meta.max_query_len == 1
        if dispatch == "unified":
            rows = self.launch.decode_q_rows if all_decode else None
            self._varlen(query, kv_cache, out, meta, scale, rows, False, window, cap, sinks)
            return out
        if all_decode or dispatch == "per_request":
            self._decode(query, kv_cache, out, meta, scale, window, cap, sinks)
        if not all_decode:
            self._varlen(query, kv_cache, out, meta, scale, None,
                         dispatch == "per_request", window, cap, sinks)
        return out

    def num_splits(self, meta: AttentionMetadata, num_kv_heads: int,
                   device: torch.device, window: int = 0) -> int:
        """Decode splits for this batch: fixed, or the heuristic's (host ints, no sync), which
        sizes them for the keys a query reads: at most `window` of them when it is set.
        num_kv_heads: the decode programs per request and split (decode_head_programs)."""
        keys = min(meta.max_seq_len, window) if window else meta.max_seq_len
        return self.launch.splits_for(meta.num_reqs, num_kv_heads, keys, self._sms(device))

    def _decode(self, query, kv_cache, out, meta: AttentionMetadata, scale: float,
                window: int, softcap: float, sinks: torch.Tensor | None) -> None:
        splits = self.num_splits(meta, self.decode_head_programs(query, kv_cache),
                                 query.device, window)
        paged_decode_attention(query, kv_cache, out, meta.query_start_loc, meta.seq_lens,
                               meta.block_table, meta.num_reqs, splits, scale,
                               launch=self.launch, order=meta.decode_order, window=window,
                               softcap=softcap, sinks=sinks)

    def decode_head_programs(self, query: torch.Tensor, kv_cache: torch.Tensor) -> int:
        """Decode programs per request and split: the kv heads times the tiles each one's
        query heads are cut into (a wide head's G tiles: MLA's 128 heads on its one latent
        head run 8 programs), so the split heuristic counts the programs that really run."""
        num_kv_heads = kv_cache.shape[3]
        shape = decode_tile_shape(self.launch, query.shape[1] // num_kv_heads, query.shape[2],
                                  kv_cache.element_size())
        return num_kv_heads * shape.g_tiles

    def _varlen(self, query, kv_cache, out, meta: AttentionMetadata, scale: float,
                block_q_rows: int | None, skip_decodes: bool, window: int,
                softcap: float, sinks: torch.Tensor | None) -> None:
        paged_prefill_attention(query, kv_cache, out, meta.query_start_loc, meta.seq_lens,
                                meta.block_table, meta.num_reqs, meta.num_actual_tokens, scale,
                                block_q_rows=block_q_rows, launch=self.launch,
                                skip_decodes=skip_decodes, window=window,
                                softcap=softcap, sinks=sinks)

    def _sms(self, device: torch.device) -> int:
        """Streaming multiprocessors on `device`, asked once per device."""
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda" else CPU_NUM_SMS)
        return self._num_sms[device]
