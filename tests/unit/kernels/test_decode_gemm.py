"""kernels/decode_gemm.py: the split-K GEMM equals F.linear (Triton interpreter on CPU), for split
counts that do and do not divide K and shapes that are not multiples of the tiles."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
import torch
import torch.nn.functional as F

from tests.support.triton_mode import needs_kernels


@needs_kernels
@pytest.mark.parametrize("m,n,k,split", [(5, 40, 48, 1), (17, 33, 80, 3), (1, 16, 64, 4)])
def test_split_k_linear_matches_f_linear(m, n, k, split):
    from kernels.decode_gemm import split_k_linear

    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    out = split_k_linear(x, w, block_m=16, block_n=16, block_k=16, split_k=split)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_split_k_linear_refuses_mismatched_k():
    from kernels.decode_gemm import split_k_linear

    with pytest.raises(ValueError, match="need \\[M, K\\]"):
        split_k_linear(torch.zeros(2, 8), torch.zeros(4, 6), 16, 16, 16, 1)


def test_projection_shapes_follow_the_preset():
    from bench.decode_gemm import projection_shapes

    shapes = dict((name, (n, k)) for name, n, k in projection_shapes("qwen3-0.6b"))
    assert shapes == {"qkv_proj": (4096, 1024), "o_proj": (1024, 2048),
                      "gate_up_proj": (6144, 1024), "down_proj": (1024, 3072),
                      "lm_head": (151936, 1024)}


@needs_kernels
def test_decode_gemm_keeps_the_fastest_config_per_bucket_and_adds_the_bias():
    from kernels.decode_gemm import DecodeGemm

    small, big = (16, 16, 16, 1, 4, 1), (16, 16, 16, 2, 4, 1)
    timings = iter([2.0, 1.0])            # the second config times faster
    gemm = DecodeGemm(configs=[small, big], timer=lambda fn: (fn(), next(timings))[1])
    gen = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(5, 32, generator=gen), torch.randn(24, 32, generator=gen),
               torch.randn(24, generator=gen))
    torch.testing.assert_close(gemm(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert gemm.chosen == {(16, 24, 32): big}
    gemm(x[:3], w)                        # same bucket: no timing (the iterator is spent)
    assert list(gemm.chosen) == [(16, 24, 32)]


# A fresh process without TRITON_INTERPRET builds the GEMM for sm_90 in bf16 at every config.
COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import decode_gemm as dg

fn = dg._split_k_kernel
names = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")
for bm, bn, bk, split, warps, stages in dg.CONFIGS:
    constexprs = dict(zip(names, (bm, bn, bk, split)))
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16" if split == 1 else "*fp32")
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in constexprs}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages))
"""


@pytest.mark.skipif(not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="pip triton without a bundled ptxas cannot compile for sm_90")
@pytest.mark.slow
def test_every_config_compiles_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
