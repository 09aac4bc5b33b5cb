"""bench/gemm_split_k.py's split-K GEMM equals F.linear (Triton interpreter on CPU), for split
counts that do and do not divide K and shapes that are not multiples of the tiles."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_mode import needs_kernels


@needs_kernels
@pytest.mark.parametrize("m,n,k,split", [(5, 40, 48, 1), (17, 33, 80, 3), (1, 16, 64, 4)])
def test_split_k_linear_matches_f_linear(m, n, k, split):
    from bench.gemm_split_k import split_k_linear

    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    out = split_k_linear(x, w, block_m=16, block_n=16, block_k=16, split_k=split)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_split_k_linear_refuses_mismatched_k():
    from bench.gemm_split_k import split_k_linear

    with pytest.raises(ValueError, match="need \\[M, K\\]"):
        split_k_linear(torch.zeros(2, 8), torch.zeros(4, 6), 16, 16, 16, 1)


def test_projection_shapes_follow_the_preset():
    from bench.decode_gemm import projection_shapes

    shapes = dict((name, (n, k)) for name, n, k in projection_shapes("qwen3-0.6b"))
    assert shapes == {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048),
                      "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072),
                      "lm_head": (151936, 1024)}
