"""Choose an attention backend by name. Imports are lazy so optional backends cost nothing."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from kernels.attention.backend import AttentionBackend

BACKEND_NAMES = ("auto", "flash_attn", "triton", "cpu", "torch")


@dataclass(frozen=True)
class CacheLayout:
    """What a backend must accept: flash-attn's paged kernels need blocks of 256 and fp16/bf16,
    and have no attention sinks (a model with them, GPT-OSS, sets sinks); the CPU kernel takes
    some head sizes and at most cpu_paged.MAX_GROUP query heads per kv head (`group`, on a
    rank: DeepSeek's latent cache has one kv head for all of a rank's heads) and its latent
    (576) only with a value of at most the row's first 512 dims (`value_dim`: the dims of each
    cached value row the model reads, 0 for the whole head; DeepSeek's kv_lora_rank).
    kv_fp8: an fp8 cache (--kv-cache-dtype), which flash-attn cannot read."""

    block_size: int
    head_dim: int
    dtype: torch.dtype
    sinks: bool = False
    group: int = 1
    value_dim: int = 0
    kv_fp8: bool = False


def _flash_attn_fits(layout: CacheLayout | None) -> bool:
    if importlib.util.find_spec("flash_attn") is None:
        return False
    from kernels.attention.flash_attn_backend import flash_attn_supports
    if layout is not None and (layout.sinks or layout.kv_fp8):
        return False
    return layout is None or flash_attn_supports(layout.block_size, layout.head_dim,
                                                 layout.dtype)


def _cpu_kernel_fits(layout: CacheLayout | None) -> bool:
    from kernels.attention import cpu_paged
    if layout is not None and cpu_paged.layout_problem(
            layout.head_dim, layout.dtype, layout.group, layout.value_dim,
            layout.sinks) is not None:
        return False
    return cpu_paged.available()


def resolve_backend_name(name: str, device_type: str, layout: CacheLayout | None = None) -> str:
    """`auto` prefers flash-attn (when it accepts the cache layout and the model has no
    attention sinks or fp8 cache), then Triton on CUDA; on
    the CPU the compiled paged kernel (when it is built and fits the layout); else the torch
    reference."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend={name!r} is invalid: must be one of {BACKEND_NAMES}")
    if name != "auto":
        return name
    if device_type == "cuda" and _flash_attn_fits(layout):
        return "flash_attn"
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    if device_type == "cpu" and _cpu_kernel_fits(layout):
        return "cpu"
    return "torch"


def get_attention_backend(name: str, device_type: str,
                          layout: CacheLayout | None = None) -> AttentionBackend:
    resolved = resolve_backend_name(name, device_type, layout)
    if resolved == "torch":
        from kernels.attention.torch_ref import TorchAttentionBackend
        return TorchAttentionBackend()
    if resolved == "triton":
        from kernels.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if resolved == "cpu":
        from kernels.attention.cpu_paged import CpuPagedAttentionBackend, check_layout
        if layout is not None:      # named explicitly: refused rather than run as another
            check_layout(layout.head_dim, layout.dtype, layout.group, layout.value_dim,
                         layout.sinks)
        return CpuPagedAttentionBackend()
    from kernels.attention.flash_attn_backend import FlashAttnBackend, check_flash_layout
    if layout is not None and layout.sinks:
        raise ValueError("attention_backend='flash_attn' is invalid for this model: flash-attn "
                         "cannot apply its attention sinks; pick one that does: triton, cpu or "
                         "torch (or auto)")
    if layout is not None:
        check_flash_layout(layout.block_size, layout.head_dim, layout.dtype)
    return FlashAttnBackend()
