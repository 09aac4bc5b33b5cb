"""fp8 KV caches (--kv-cache-dtype, worker_service/runner/kv_dtype.py) in the Triton kernels.

The kernels get an fp8 cache as its uint8 view and code the bytes themselves (FP8 a constexpr:
0 the model dtype, FP8_E4M3 or FP8_E5M2), for two reasons:

* Triton's interpreter (the CPU tests) rounds float32 -> fp8 wrongly: a value rounding up into
  the next power of two can lose the carry (7.94 -> 4.0, not 8.0) and subnormals round down
  (of 4,096 values randn x 10, 105 e4m3 and 165 e5m2 bytes differed from torch's in triton
  3.9), so a native fp8 store would test another rounding than the GPU's;
* a byte pointer compiles on every GPU, where tl.float8e4nv pointers need sm_89 or newer.

Writes (`encode`) round to nearest even and saturate at the type's largest finite value, byte
for byte torch's `x.clamp(-max, max).to(fp8)` (kernels/attention/torch_ref.to_cache_dtype);
NaN stays NaN (0x7F | sign). Reads (`decode`) widen exactly to float32: e5m2 is float16's high
byte, e4m3's 7 magnitude bits shifted into float16's exponent and mantissa fields read 2^-8
of the value (subnormals included), so one multiply by 256 rescales it (0x7F | sign: NaN).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_E4M3 = tl.constexpr(1)
FP8_E5M2 = tl.constexpr(2)
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def cache_operand(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor a kernel gets, its FP8 code): an fp8 cache as its uint8 view, else itself
    and 0. The view shares the storage and strides (one byte a value either way)."""
    code = FP8_CODES.get(kv_cache.dtype, 0)
    return (kv_cache.view(torch.uint8) if code else kv_cache), code


@triton.jit
def decode(b, FP8: tl.constexpr):
    """uint8 codes -> float32 values (exact)."""
    h = b.to(tl.uint16)
    if FP8 == FP8_E5M2:
        return (h << 8).to(tl.float16, bitcast=True).to(tl.float32)
    half = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
    x = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((h & 0x7F) == 0x7F, float("nan"), x)       # e4m3fn's one NaN code


@triton.jit
def encode(x, FP8: tl.constexpr):
    """float values -> uint8 codes, rounded to nearest even and saturated (module docstring)."""
    if FP8 == FP8_E5M2:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        LIMIT: tl.constexpr = 57344.0
        SUB_SCALE: tl.constexpr = 65536.0       # 2^(BIAS - 1 + MANT): one subnormal step = 1
        MIN_NORMAL: tl.constexpr = 6.103515625e-05    # 2^-14
    else:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        LIMIT: tl.constexpr = 448.0
        SUB_SCALE: tl.constexpr = 512.0
        MIN_NORMAL: tl.constexpr = 0.015625          # 2^-6
    SHIFT: tl.constexpr = 23 - MANT
    x = x.to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    mag = tl.minimum(tl.abs(x), LIMIT)                       # saturate (NaN handled below)
    mbits = mag.to(tl.uint32, bitcast=True)
    # normal: round the float32 mantissa to MANT bits (ties to even; a carry moves into the
    # exponent), then rebias the exponent from 127 to BIAS
    rounded = (mbits + ((1 << (SHIFT - 1)) - 1) + ((mbits >> SHIFT) & 1)) >> SHIFT
    normal = rounded - ((127 - BIAS) << MANT)
    # subnormal (below 2^(1 - BIAS)): the count of 2^(1 - BIAS - MANT) steps, rounded to
    # nearest even by the float32 add (2^23 has an ulp of 1); 2^MANT steps is the smallest
    # normal, whose code is the same number
    steps = (mag * SUB_SCALE + 8388608.0).to(tl.uint32, bitcast=True) & 0xFF
    small = mag < MIN_NORMAL
    code = tl.where(small, steps, normal).to(tl.uint8)
    code = tl.where(x != x, 0x7F, code)
    return code | sign


@triton.jit
def store_cache(ptr, x, mask, FP8: tl.constexpr):
    """Store x into the cache at ptr: fp8 codes (FP8), else cast to the cache's dtype."""
    if FP8 != 0:
        tl.store(ptr, encode(x, FP8), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)
