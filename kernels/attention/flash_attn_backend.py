"""The flash-attn backend: Triton KV write by slot mapping, then flash-attn over the paged cache.

Our cache layout (see backend.py) already is flash-attn's paged layout, one view per K and V:

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache[0] -> k_cache [num_blocks, page_block_size, nheads_k, headdim]   (flash-attn names)
    kv_cache[1] -> v_cache

* pure decode (every request has exactly one query row): `flash_attn_with_kvcache` with
  block_table and cache_seqlens = seq_lens. Its split count is picked on the host from shapes
  only, so it is CUDA-graph capturable.
* anything else (prefill, chunked prefill, mixed): `flash_attn_varlen_func` with block_table,
  cu_seqlens_q = query_start_loc and cu_seqlens_k = [0, cumsum(seq_lens)] built on the device.
  flash-attn aligns the causal mask bottom-right, which is our rule: a request's queries are its
  last query_len positions.
* a sliding window W (backend.py) is flash-attn's window_size=(W - 1, 0) on both entry points
  (W - 1 keys left of the query's own, none right: p - W < k <= p); without one the calls are
  made as before.
* an attention softcap (backend.py, Gemma 2) is flash-attn's own softcap argument (>= 2.6, the
  version required here), on both entry points.

Constraints of upstream flash-attn 2 (checked here, raised as ValueError naming the value):
* the paged block size must be a multiple of 256 (flash_api.cpp: "Paged KV cache block size must
  be divisible by 256", in both varlen_fwd and fwd_kvcache). Run with --block-size 256 to use it;
  with the default block size 16 pick the Triton backend.
* fp16 or bf16 only; head_dim <= 256 and a multiple of 8 (otherwise flash-attn pads q/k/v, and
  here k/v are the whole cache).
* `block_table` on the varlen entry point needs flash-attn >= 2.6.

flash_attn is imported when the backend is constructed, never at module import, so this module
imports (and its checks run) on machines without it.
"""
from __future__ import annotations

import importlib
import re
from types import ModuleType

import torch
import torch.nn.functional as F

from kernels.attention.backend import (AttentionBackend, AttentionMetadata, check_sliding_window,
                                       check_softcap)

PAGED_BLOCK_MULTIPLE = 256          # upstream flash-attn 2 paged-KV rule
MIN_FLASH_ATTN_VERSION = (2, 6)     # varlen + block_table
FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class FlashAttnUnavailable(ImportError):
    """flash_attn is missing or too old for the paged entry points."""


def import_flash_attn() -> ModuleType:
    """The flash_attn package, checked for the paged varlen API (>= 2.6)."""
    try:
        module = importlib.import_module("flash_attn")
    except ImportError as e:
        raise FlashAttnUnavailable(
            "attention_backend='flash_attn' needs the flash_attn package "
            "(pip install 'deltaserve[flash]'); use 'triton' or 'auto' instead") from e
    text = str(getattr(module, "__version__", "0"))
    if _version_tuple(text) < MIN_FLASH_ATTN_VERSION:
        raise FlashAttnUnavailable(
            f"flash_attn {text} is too old: the paged varlen entry point needs "
            f">= {'.'.join(map(str, MIN_FLASH_ATTN_VERSION))}")
    return module


def _version_tuple(text: str) -> tuple[int, ...]:
    """'2.6.3' -> (2, 6, 3); '2.7.0.post2' -> (2, 7, 0); unparsable -> ()."""
    match = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def check_flash_layout(block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    """Raise ValueError unless flash-attn's paged kernels accept this cache geometry."""
    if block_size % PAGED_BLOCK_MULTIPLE:
        raise ValueError(f"block_size={block_size} is invalid for the flash_attn backend: "
                         f"flash-attn's paged KV cache needs a multiple of "
                         f"{PAGED_BLOCK_MULTIPLE} (use --block-size 256, or the triton "
                         f"backend for smaller blocks)")
    if dtype not in FLASH_DTYPES:
        raise ValueError(f"dtype={dtype} is invalid for the flash_attn backend: must be one of "
                         f"{FLASH_DTYPES}")
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(f"head_dim={head_dim} is invalid for the flash_attn backend: must be "
                         f"a multiple of 8 and <= {MAX_HEAD_DIM}")


def flash_attn_supports(block_size: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether check_flash_layout passes (for `auto` backend selection)."""
    try:
        check_flash_layout(block_size, head_dim, dtype)
    except ValueError:
        return False
    return True


def cu_seqlens_k(seq_lens: torch.Tensor) -> torch.Tensor:
    """int32 [num_reqs + 1]: 0 then the running sum of seq_lens, on seq_lens' device (no sync)."""
    return F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))


def is_one_token_per_request(meta: AttentionMetadata) -> bool:
    """Pure decode in row order: request i's only query row is row i (host ints only)."""
    return meta.max_query_len == 1 and meta.num_actual_tokens == meta.num_reqs


class FlashAttnBackend(AttentionBackend):
    """Paged attention through flash-attn 2's varlen and kvcache entry points (CUDA only)."""

    name = "flash_attn"
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self) -> None:
        fa = import_flash_attn()
        self._varlen = fa.flash_attn_varlen_func
        self._with_kvcache = fa.flash_attn_with_kvcache
        self._write = _kv_writer()
        self._checked: set[tuple] = set()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        window = check_sliding_window(sliding_window)
        extra = {"window_size": (window - 1, 0)} if window else {}
        if check_softcap(softcap):
            extra["softcap"] = softcap
        self._check_once(kv_cache, query)
        num_tokens = meta.num_actual_tokens
        self._write(key, value, kv_cache, meta.slot_mapping[:num_tokens])
        if meta.num_reqs == 0 or num_tokens == 0:
            return torch.zeros_like(query)
        if is_one_token_per_request(meta):
            out = self._with_kvcache(
                query[:num_tokens].unsqueeze(1), kv_cache[0], kv_cache[1],
                cache_seqlens=meta.seq_lens, block_table=meta.block_table,
                softmax_scale=scale, causal=True, **extra).squeeze(1)
        else:
            out = self._varlen(
                query[:num_tokens], kv_cache[0], kv_cache[1], meta.query_start_loc,
                cu_seqlens_k(meta.seq_lens), meta.max_query_len, meta.max_seq_len,
                softmax_scale=scale, causal=True, block_table=meta.block_table, **extra)
        return _pad_rows(out, query.shape[0])

    def _check_once(self, kv_cache: torch.Tensor, query: torch.Tensor) -> None:
        key = (tuple(kv_cache.shape), kv_cache.dtype, query.dtype)
        if key in self._checked:
            return
        if query.dtype != kv_cache.dtype:
            raise ValueError(f"query dtype {query.dtype} differs from kv_cache dtype "
                             f"{kv_cache.dtype}: flash-attn needs them equal")
        check_flash_layout(kv_cache.shape[2], kv_cache.shape[4], kv_cache.dtype)
        self._checked.add(key)


def _pad_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
    """out [n, H, D] as [rows, H, D]: rows past n are zero (they are undefined by contract)."""
    if out.shape[0] == rows:
        return out
    padded = out.new_zeros((rows,) + tuple(out.shape[1:]))
    padded[:out.shape[0]] = out
    return padded


def _kv_writer():
    """The slot-mapping KV write: the Triton kernel (sync-free, capturable), else the torch one."""
    try:
        from kernels.attention.triton_cache import triton_write_kv_cache
        return triton_write_kv_cache
    except ImportError:
        from kernels.attention.torch_ref import write_kv_cache
        return write_kv_cache
