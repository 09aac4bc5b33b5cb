"""The KV cache's element type (--kv-cache-dtype, vLLM's flag) and the layouts it is built for.

    auto       the model dtype (float32 / bfloat16 / float16): what every backend reads
    fp8        on the CPU fp8_e5m2, as vLLM-CPU (bfloat16 -> e5m2 keeps bf16's exponent range
               and rounds the mantissa to 2 bits; float16's high byte is e5m2 exactly, so the
               kernel widens a byte with one shift)
    fp8_e5m2   torch.float8_e5m2:   1 sign, 5 exponent, 2 mantissa bits, max 57344
    fp8_e4m3   torch.float8_e4m3fn: 1 sign, 4 exponent, 3 mantissa bits, max 448

One byte per value, scale 1.0: there are no calibrated per-tensor scales. A checkpoint's
k_scale / v_scale tensors are not read (vLLM without them also uses 1.0); keys and values are
rounded to nearest and saturated at the type's largest finite value (write_kv_cache), so an
activation past 448 (e4m3) is clipped, not turned into NaN.

Built: the torch backend and the CPU paged kernel (kernels/cpu/csrc), for full-attention
decoders without sinks. Refused at start, naming the flag and the value (`fp8_problem`): a CUDA
device (the Triton and flash-attn backends read the model dtype only), a latent cache (MLA),
attention sinks, sliding windows (hybrid KV pools included), and any other backend (the Triton
interpreter on the CPU).
"""
from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
CPU_FP8 = "fp8_e5m2"      # what plain `fp8` means on the CPU (vLLM-CPU's choice)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for --kv-cache-dtype `name` (auto: the model's)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        name = CPU_FP8
    if name not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is invalid: must be one of auto, fp8, "
                         f"{', '.join(FP8_DTYPES)}")
    return FP8_DTYPES[name]


BUILT_BACKENDS = ("torch", "cpu")


def fp8_problem(name: str, device_type: str, *, latent: bool, sinks: bool,
                windows: tuple[int, ...], backend: str = "cpu") -> str | None:
    """Why --kv-cache-dtype `name` cannot run this model here (None: it can, or it is auto)."""
    if name == "auto":
        return None
    why = None
    if device_type != "cpu":
        why = (f"the {device_type} attention backends (triton, flash_attn) read a cache in the "
               "model dtype only; fp8 caches run on the CPU")
    elif backend not in BUILT_BACKENDS:
        why = (f"attention_backend={backend!r} reads a cache in the model dtype only; fp8 "
               f"caches run on {' and '.join(BUILT_BACKENDS)}")
    elif latent:
        why = "a latent (MLA) cache is not built for fp8; its kernel reads the model dtype"
    elif sinks:
        why = "attention sinks with an fp8 cache are not built"
    elif any(windows):
        why = "sliding-window layers (and hybrid KV pools) with an fp8 cache are not built"
    if why is None:
        return None
    return f"--kv-cache-dtype {name} is refused for this model: {why}; use --kv-cache-dtype auto"
