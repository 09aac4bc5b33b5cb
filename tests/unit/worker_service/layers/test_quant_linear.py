"""layers/quant_linear.py: torch's weight-only int4 / int8 CPU kernels against F.linear on the
same weights dequantized (the load-time path), and what they cannot run falling back."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import int4_gemm
from worker_service.layers import quant_linear
from worker_service.layers.quant_linear import PackedBand, PackedRows, build, dequantize


@pytest.fixture(autouse=True)
def float32_too(monkeypatch):
    """The float32 kernel path is scalar (slow, so models do not take it) but exact: checked."""
    monkeypatch.setattr(quant_linear, "NATIVE_DTYPES", (torch.bfloat16, torch.float32))


def band(n: int, k: int, group: int, bits: int = 4, seed: int = 0, zero_low: int = 1):
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen).to(torch.uint8)
    zeros = torch.randint(zero_low, zero_low + (1 << bits), (groups, n), generator=gen,
                          dtype=torch.int32)
    if bits == 8:
        zeros.fill_(128)
    scales = (0.01 * (0.5 + torch.rand(groups, n, generator=gen))).to(torch.float16)
    return PackedBand(codes, zeros, scales, group, bits)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


# float32: the same products summed in another order; bfloat16: scale and zero kept in
# bfloat16 (the kernel's rule) and the output rounded to it
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,bits", [(32, 4), (128, 4), (512, 4), (256, 8)])
def test_kernel_matches_dequantized_linear(dtype, group, bits):
    n, k = 96, 512 if bits == 4 else 256
    b = band(n, k, group, bits, zero_low=0 if bits == 8 else 1)
    linear = build(b, dtype)
    assert not isinstance(linear, str), linear
    assert linear.kind == ("int4" if bits == 4 else "int8")
    w = dequantize(b)
    bias = torch.randn(n).to(dtype)
    for m in (1, 7, 64, 300):
        x = torch.randn(m, k).to(dtype)
        want = F.linear(x.float(), w, bias.float())
        got = linear(x, None, bias)
        assert got.dtype == dtype and got.shape == (m, n)
        assert rel_err(got, want) < BOUNDS[dtype], (m, rel_err(got, want))
    assert linear.calls == 4


def test_packed_is_a_quarter_of_bfloat16():
    b = band(256, 1024, 128)
    linear = build(b, torch.bfloat16)
    assert linear.packed.nbytes == 256 * 1024 // 2
    assert linear.nbytes < 256 * 1024 * 2 // 3


@pytest.mark.parametrize("b,why", [
    (band(32, 64, 16), "not a multiple of 32"),
    (band(24, 64, 32), "not a multiple of 16"),
    (band(32, 128, 64, bits=8), "one scale per output row"),
    (PackedBand(torch.zeros(32, 96, dtype=torch.uint8), torch.zeros(2, 32, dtype=torch.int32),
                torch.ones(2, 32), 64, 4), "partial group"),
])
def test_what_the_kernels_cannot_run_says_why(b, why):
    assert why in build(b, torch.float32)


def test_8bit_zero_points_off_128_fall_back():
    b = band(32, 64, 64, bits=8)
    b.zeros.fill_(100)
    assert "outside int8" in build(b, torch.float32)


def test_float32_and_float16_models_stay_dequantized(monkeypatch):
    monkeypatch.undo()
    for dtype in (torch.float32, torch.float16):
        assert "vectorized for torch.bfloat16 only" in build(band(32, 64, 32), dtype)


def test_wrong_input_dtype_is_refused():
    linear = build(band(32, 64, 32), torch.bfloat16)
    with pytest.raises(TypeError, match="float32 does not match"):
        linear(torch.randn(2, 64))


def test_pieces_join_in_row_order_and_refuse_what_does_not_fit():
    rows = PackedRows(64, 64)
    top, bottom = band(32, 64, 32, seed=1), band(32, 64, 32, seed=2)
    rows.add(32, bottom)
    assert not rows.complete
    rows.add(0, top)
    assert rows.complete
    joined = rows.joined()
    assert torch.equal(dequantize(joined), torch.cat([dequantize(top), dequantize(bottom)]))
    with pytest.raises(ValueError, match="does not fit the weight"):
        rows.add(48, band(32, 64, 32))
    dense = torch.empty(64, 64)
    rows.write_dequantized(dense)
    assert torch.equal(dense, dequantize(joined))


# GPTQ symmetric (zero 8), asymmetric (any zero; AWQ's bands take this form too); N = 80 and
# 112 end in partial 64-row blocks, K = 320 in a partial 256-value chunk of int4_gemm's kernel
@pytest.mark.parametrize("zero_low,group,n,k", [(8, 32, 80, 320), (0, 64, 112, 320),
                                                (1, 128, 80, 384)])
def test_many_rows_take_the_panel_kernel_and_match(zero_low, group, n, k):
    b = band(n, k, group, zero_low=zero_low, seed=group)
    if zero_low == 8:
        b.zeros.fill_(8)
    linear = build(b, torch.bfloat16)
    w = dequantize(b).bfloat16().float()          # the dequantized load's bfloat16 weight
    rows = (1, 5, int4_gemm.MIN_ROWS - 1, int4_gemm.MIN_ROWS, 17, 64, 300)
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        want = x.float() @ w.t()
        assert rel_err(linear(x), want) < BOUNDS[torch.bfloat16], m
    many = [m for m in rows if int4_gemm.wanted(m)]
    assert linear.many_row_calls == len(many)
    if int4_gemm.extension.ops().bf16_dot():
        assert many == [m for m in rows if m >= int4_gemm.MIN_ROWS]
