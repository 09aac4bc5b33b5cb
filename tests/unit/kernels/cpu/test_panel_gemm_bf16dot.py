"""panel_linear_many (kernels/cpu/csrc/panel_gemm_bf16dot.cpp): a long prefill's expert GEMMs
on the panels in place. bfloat16 on AVX512-BF16 pairs equals F.linear's bf16 GEMM on the dense
weight within one rounding (row counts around the 12-row blocks, partial last panels, a bias);
float32, an odd k and builds without the dot products are panel_linear's; panels that do not
match x are refused naming both shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import extension

pytestmark = [pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]


def case(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + rows + k + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (0.1 * torch.randn(n, k, generator=gen)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return x, w, bias


def test_the_dot_products_are_compiled_where_the_cpu_has_them(ops, cpu_isa):
    flags = set(extension.cpu_flags().split())
    expected = cpu_isa == "native" and {"avx512f", "avx512_bf16"} <= flags
    assert ops.panel_bf16_dot() is expected


@pytest.mark.parametrize("rows", [1, 11, 12, 13, 64, 200])
@pytest.mark.parametrize("n", [64, 100, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_equals_f_linear_within_one_rounding(ops, rows, n, with_bias):
    x, w, bias = case(rows, 96, n, torch.bfloat16)
    b = bias if with_bias else None
    got = ops.panel_linear_many(x, ops.panel_pack(w), n, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # one bf16 rounding of the float32 sum: relative 2^-8, plus the sums' order
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-5)
    torch.testing.assert_close(got, F.linear(x, w, b))


@pytest.mark.parametrize("rows", [5, 130])
def test_a_slice_of_x_rows_and_many_slices(ops, rows):
    """k = 2048: the kernel walks x in slices of 96 rows (384 KiB), so 130 rows take two, the
    second a partial row block; each row's output is its own (a row alone gives the same
    bits)."""
    x, w, _ = case(rows, 2048, 40, torch.bfloat16, seed=3)
    panels = ops.panel_pack(w)
    got = ops.panel_linear_many(x, panels, 40, None)
    torch.testing.assert_close(got, F.linear(x, w))
    assert torch.equal(got[rows - 1:], ops.panel_linear_many(x[rows - 1:].contiguous(),
                                                             panels, 40, None))


@pytest.mark.parametrize("dtype, k", [(torch.float32, 96), (torch.bfloat16, 95)])
def test_float32_and_odd_k_are_panel_linear(ops, dtype, k):
    x, w, bias = case(30, k, 70, dtype, seed=1)
    panels = ops.panel_pack(w)
    assert torch.equal(ops.panel_linear_many(x, panels, 70, bias),
                       ops.panel_linear(x, panels, 70, bias))


def test_mismatched_panels_and_bias_are_refused(ops):
    x, w, _ = case(4, 64, 64, torch.bfloat16)
    panels = ops.panel_pack(w)
    with pytest.raises(RuntimeError, match=r"panels|x must be|do not match"):
        ops.panel_linear_many(x, panels, 100, None)
    with pytest.raises(RuntimeError, match=r"panels|do not match"):
        ops.panel_linear_many(x[:, :32].contiguous(), panels, 64, None)
    if ops.panel_bf16_dot():
        with pytest.raises(RuntimeError, match=r"bias must be \[64\], got \[63\]"):
            ops.panel_linear_many(x, panels, 64, torch.zeros(63, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 200), (torch.bfloat16, 5),
                                         (torch.bfloat16, 200)])
def test_an_empty_k_gives_the_bias(ops, dtype, rows):
    """k = 0 (a GEMM with no inner dimension): F.linear's answer, the bias in every row; the
    row slices' sizes divided by k and killed the process (SIGFPE)."""
    panels = ops.panel_pack(torch.zeros(64, 0, dtype=dtype))
    bias = torch.arange(64, dtype=dtype)
    x = torch.zeros(rows, 0, dtype=dtype)
    for fn in (ops.panel_linear_many, ops.panel_linear):
        assert torch.equal(fn(x, panels, 64, bias), bias.expand(rows, 64))
        assert torch.equal(fn(x, panels, 64, None), torch.zeros(rows, 64, dtype=dtype))
