"""The CPU attention backend: the deltaserve_cpu library's paged attention kernel
(kernels/cpu/csrc/paged_attention.cpp), which reads keys and values in place from the paged cache,
one work item per (request, kv head, tile of query tokens), flash style, in float32.

It writes the cache as the torch backend does (one index_copy_ per K and V), then attends every
request of the batch, prefills and decodes alike, in one call: no gather, no padding. Supported:
float32 and bfloat16, head_dim 16/32/64/80/96/128 and DeepSeek's MLA latent (576: its value is
the first 512 dims of the same cached row, forward's v_head_dim), up to 128 query heads per kv
head (past 48 the kernel cuts them into head tiles); `supports`
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

HEAD_DIMS = (16, 32, 64, 80, 96, 128, 576)
# head dims whose value is a prefix of the key row in the kernel: the MLA latent (kv_lora_rank
# 512 + rope 64; the value is the latent, its first 512). Other value prefixes are attended at
# the full head and sliced (forward).
VALUE_PREFIX_DIMS = {576: 512}
DTYPES = (torch.float32, torch.bfloat16)
MAX_GROUP = 128


def layout_problem(head_dim: int, dtype: torch.dtype, group: int, value_dim: int = 0,
                   sinks: bool = False) -> str | None:
    """What the kernel cannot take in this layout (the refusal of an explicit
    attention_backend='cpu'), or None when it fits. value_dim: the value dims the layer reads
    of each cached value row (0: the whole head); sinks: the model has attention sinks."""
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
    return _value_problem(head_dim, value_dim or head_dim, sinks)


def _value_problem(head_dim: int, value_dim: int, sinks: bool) -> str | None:
    """A head the kernel attends only as a latent (its value a prefix of the row): the value
    must fit the prefix, and there are no sinks (forward: check_value_prefix)."""
    prefix = VALUE_PREFIX_DIMS.get(head_dim)
    if prefix is None:
        return None
    if value_dim > prefix:
        return (f"attention_backend='cpu' is invalid for this model: its cached head size "
                f"{head_dim} with a value of {value_dim} dims; the cpu kernel takes "
                f"{head_dim} only as MLA's latent, a value of at most its first {prefix} "
                "(kv_lora_rank); pick torch (or auto, which picks it)")
    if sinks:
        return (f"attention_backend='cpu' is invalid for this model: attention sinks with "
                f"its cached head size {head_dim} (a latent whose value is its first "
                f"{prefix} dims): the cpu kernel takes sinks only with whole-head values; pick "
                "torch (or auto, which picks it)")
    return None


def check_value_prefix(v_head_dim: int, head_dim: int, window: int,
                       sinks: torch.Tensor | None) -> int:
    """The value head dim forward returns (v_head_dim, or head_dim for 0), else ValueError: it
    must lie in 1..head_dim, and a value narrower than the head (MLA) takes no window or sinks."""
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or not (
            0 <= v_head_dim <= head_dim):
        raise ValueError(f"v_head_dim={v_head_dim!r} is invalid: must be an int in 0..{head_dim} "
                         "(0: the whole head)")
    v_dim = v_head_dim or head_dim
    if v_dim != head_dim and (window or sinks is not None):
        raise ValueError(f"v_head_dim={v_dim} with head_dim={head_dim}: the cpu kernel takes no "
                         f"sliding window (got {window}) or attention sinks (got "
                         f"{'some' if sinks is not None else 'none'}) with a value narrower than "
                         "the head (MLA has neither)")
    return v_dim


def check_layout(head_dim: int, dtype: torch.dtype, group: int, value_dim: int = 0,
                 sinks: bool = False) -> None:
    """ValueError naming what the kernel cannot take (an explicit attention_backend='cpu')."""
    problem = layout_problem(head_dim, dtype, group, value_dim, sinks)
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
    supports_value_prefix = True    # forward's v_head_dim (worker_service/layers/attention.py)

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
                sinks: torch.Tensor | None = None, v_head_dim: int = 0) -> torch.Tensor:
        """v_head_dim: 0 (the value is the whole head), or the first v_head_dim dims of each
        cached value row (MLA); the output is then [T, Hq, v_head_dim]."""
        window = check_sliding_window(sliding_window)
        sinks = check_sinks(sinks, query.shape[1])
        v_dim = check_value_prefix(v_head_dim, query.shape[-1], window, sinks)
        if check_softcap(softcap):
            self.capped_calls += 1
            out = self._capped.forward(query, key, value, kv_cache, meta, scale,
                                       sliding_window=window, softcap=softcap, sinks=sinks)
            return out[..., :v_dim]
        write_kv_cache(key, value, kv_cache, meta.slot_mapping[:meta.num_actual_tokens])
        head_dim = query.shape[-1]
        kernel_v = VALUE_PREFIX_DIMS.get(head_dim, head_dim)
        if v_dim > kernel_v:
            raise ValueError(f"v_head_dim={v_dim} with head_dim={head_dim}: the cpu kernel "
                             f"returns at most the first {kernel_v} value dims of this head")
        out = query.new_empty(query.shape[0], query.shape[1], kernel_v)
        num_reqs = meta.num_reqs
        if num_reqs:
            self._op(query, kv_cache, meta.block_table, meta.query_start_loc_cpu[:num_reqs + 1],
                     meta.seq_lens_cpu[:num_reqs], scale, out, window, sinks)
        self.calls += 1
        return out if v_dim == kernel_v else out[..., :v_dim]
