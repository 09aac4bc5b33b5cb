"""The CPU attention backend: the deltaserve_cpu library's paged attention kernel
(kernels/cpu/csrc/paged_attention.cpp), which reads keys and values in place from the paged cache,
one work item per (request, kv head, tile of query tokens), flash style, in float32.

It writes the cache as the torch backend does (one index_copy_ per K and V), then attends every
request of the batch, prefills and decodes alike, in one call: no gather, no padding. Supported:
float32 and bfloat16, head_dim 16/32/64/80/96/128, up to 48 query heads per kv head; `supports`
says whether a layout fits, and the selector's `auto` falls back to the torch backend when it
does not or when the library could not be built; `cpu` named for a layout it does not fit is
refused (check_layout), so the backend reported is the one that runs. A sliding window
(backend.py) is the kernel's `window` argument: items skip the chunks below it and mask the keys
a row no longer sees. Attention
sinks (GPT-OSS) are the kernel's `sinks` argument (float32 [Hq]): each row's denominator gains
e^(sink) when the row is stored; without them the kernel runs as before.
The kernel has no attention softcap (Gemma 2): a call with one is handed to the torch backend,
which reads and writes the same cache layout, so a capped layer is exact rather than uncapped.
"""
from __future__ import annotations

import torch

from kernels.attention.backend import (AttentionBackend, AttentionMetadata, check_sinks,
                                       check_sliding_window, check_softcap)
from kernels.attention.torch_ref import TorchAttentionBackend, write_kv_cache
from kernels.cpu import extension

HEAD_DIMS = (16, 32, 64, 80, 96, 128)
DTYPES = (torch.float32, torch.bfloat16)
MAX_GROUP = 48


def layout_problem(head_dim: int, dtype: torch.dtype, group: int) -> str | None:
    """What the kernel cannot take in this layout (the refusal of an explicit
    attention_backend='cpu'), or None when it fits."""
    if head_dim not in HEAD_DIMS:
        return (f"attention_backend='cpu' is invalid for this model: its cached head "
                f"size {head_dim} is not one the cpu kernel takes {HEAD_DIMS}; pick "
                "torch (or auto, which picks it)")
    if dtype not in DTYPES:
        return (f"attention_backend='cpu' is invalid with dtype {dtype}: must be one "
                f"of {DTYPES}; pick torch (or auto, which picks it)")
    if group > MAX_GROUP:
        return (f"attention_backend='cpu' is invalid for this model: {group} query "
                f"heads per kv head on a rank, the cpu kernel takes at most "
                f"{MAX_GROUP}; pick torch (or auto, which picks it)")
    return None


def check_layout(head_dim: int, dtype: torch.dtype, group: int) -> None:
    """ValueError naming what the kernel cannot take (an explicit attention_backend='cpu')."""
    problem = layout_problem(head_dim, dtype, group)
    if problem is not None:
        raise ValueError(problem)


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles this cache layout (heads per kv head is checked per call)."""
    return head_dim in HEAD_DIMS and dtype in DTYPES


def available() -> bool:
    """The library is built and loaded (builds it on first call)."""
    return extension.load()


class CpuPagedAttentionBackend(AttentionBackend):
    """Paged attention in place on the CPU. The metadata's *_cpu tensors (int32, host) give the
    batch layout; block_table must be int32 with contiguous rows."""

    name = "cpu"
    supports_sliding_window = True
    supports_softcap = True        # through the torch backend (module docstring)
    supports_sinks = True

    def __init__(self) -> None:
        if not available():
            raise RuntimeError(f"the cpu attention backend needs the deltaserve_cpu library: "
                               f"{extension.status()}")
        self._op = extension.ops().paged_attention
        self.calls = 0              # forward calls (tests check the kernel really ran)
        self.capped_calls = 0       # calls handed to the torch backend for their softcap
        self._capped = TorchAttentionBackend()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int = 0, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        window = check_sliding_window(sliding_window)
        sinks = check_sinks(sinks, query.shape[1])
        if check_softcap(softcap):
            self.capped_calls += 1
            return self._capped.forward(query, key, value, kv_cache, meta, scale,
                                        sliding_window=window, softcap=softcap, sinks=sinks)
        write_kv_cache(key, value, kv_cache, meta.slot_mapping[:meta.num_actual_tokens])
        out = torch.empty_like(query)
        num_reqs = meta.num_reqs
        if num_reqs:
            self._op(query, kv_cache, meta.block_table, meta.query_start_loc_cpu[:num_reqs + 1],
                     meta.seq_lens_cpu[:num_reqs], scale, out, window, sinks)
        self.calls += 1
        return out
