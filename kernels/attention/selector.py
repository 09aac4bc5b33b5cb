"""Choose an attention backend by name. Imports are lazy so optional backends cost nothing."""
from __future__ import annotations

import importlib.util

from kernels.attention.backend import AttentionBackend

BACKEND_NAMES = ("auto", "flash_attn", "triton", "torch")


def resolve_backend_name(name: str, device_type: str) -> str:
    """`auto` prefers flash-attn, then Triton on CUDA, then the torch reference."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend={name!r} is invalid: must be one of {BACKEND_NAMES}")
    if name != "auto":
        return name
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attn"
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def get_attention_backend(name: str, device_type: str) -> AttentionBackend:
    resolved = resolve_backend_name(name, device_type)
    if resolved == "torch":
        from kernels.attention.torch_ref import TorchAttentionBackend
        return TorchAttentionBackend()
    if resolved == "triton":
        from kernels.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    from kernels.attention.flash_attn_backend import FlashAttnBackend
    return FlashAttnBackend()
