"""The deltaserve_cpu library's fused per-token operations, for the model's layers and the
sampler (C++ in csrc/elementwise.cpp; the same roundings as the torch reference in bf16):

    rms_norm(x, w, eps) / add_rms_norm(x, residual, w, eps)   residual updated in place
    rope(positions, q, k, cos_cache, sin_cache)                q, k rotated in place (a
                                                               position outside the caches,
                                                               or not one per token: error)
    silu_and_mul(x)                                            [T, 2I] -> [T, I]
    greedy_sample(logits, logprobs=True) -> (ids, logprobs)    one pass per row (False: ids
                                                               alone, logprobs empty)

`ops_for(dtype)` is the library's op namespace when it is loaded and handles `dtype` (float32,
bfloat16), else None: callers then keep their torch code.
"""
from __future__ import annotations

import torch

from kernels.cpu import extension

DTYPES = (torch.float32, torch.bfloat16)


def ops_for(dtype: torch.dtype):
    """torch.ops.deltaserve_cpu when the library is loaded and takes `dtype`, else None."""
    if dtype not in DTYPES or not extension.load():
        return None
    return extension.ops()
