"""MXFP4 dequantization (models/mxfp4.py) against transformers' own convert_moe_packed_tensors
on random blocks and scales (every byte and a wide exponent range), bit for bit in each dtype;
and the refusal of pieces that do not fit and of scales whose weights overflow."""
from __future__ import annotations

import pytest
import torch

from worker_service.layers.mxfp4 import dequantize_experts

transformers_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bit_for_bit_as_transformers(dtype):
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (3, 40, 5, 16), generator=gen, dtype=torch.uint8)
    top = 141 if dtype == torch.float16 else 150        # float16: 6 x 2^14 overflows
    scales = torch.randint(100, top, (3, 40, 5), generator=gen, dtype=torch.uint8)
    want = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_experts(blocks, scales, dtype)
    assert got.shape == want.shape == (3, 160, 40) and got.dtype == dtype
    assert torch.equal(got.view(torch.uint8) if dtype != torch.float32 else got,
                       want.view(torch.uint8) if dtype != torch.float32 else want)
    assert got.is_contiguous()


def test_every_code_and_its_scale():
    """Byte b of a group: its low nibble is column 2b, its high nibble 2b + 1, each times
    2^(scale - 127): group 0 holds codes 0..15 low (scale 2^0), group 1 code 3 low and
    15 - b high (scale 2^2)."""
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = torch.stack([codes, codes.flip(0) * 16 + 3]).view(1, 1, 2, 16)
    scales = torch.tensor([[[127, 129]]], dtype=torch.uint8)
    got = dequantize_experts(blocks, scales, torch.float32)[0, :, 0].tolist()
    lut = transformers_mxfp4.FP4_VALUES
    assert got[:32] == [v for b in range(16) for v in (lut[b], 0.0)]
    assert got[32:] == [4.0 * v for b in range(16) for v in (lut[3], lut[15 - b])]


@pytest.mark.parametrize("blocks,scales,match", [
    (torch.zeros(2, 4, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8),
     r"blocks \(2, 4, 3, 16\) and scales \(2, 4, 2\) do not fit"),
    (torch.zeros(2, 4, 3, 8, dtype=torch.uint8), torch.zeros(2, 4, 3, dtype=torch.uint8),
     "do not fit"),
    (torch.zeros(2, 4, 3, 16), torch.zeros(2, 4, 3, dtype=torch.uint8), "must be uint8"),
])
def test_pieces_that_do_not_fit_are_refused(blocks, scales, match):
    with pytest.raises(ValueError, match=f"down_proj: MXFP4 .*{match}"):
        dequantize_experts(blocks, scales, torch.float32, "down_proj")


@pytest.mark.parametrize("dtype,scale,ok", [
    (torch.float32, 0, True), (torch.bfloat16, 252, True), (torch.bfloat16, 253, False),
    (torch.float32, 255, False), (torch.float16, 140, True), (torch.float16, 141, False),
])
def test_scales_that_overflow_the_dtype_are_refused(dtype, scale, ok):
    """Exponent extremes: 2^(scale - 127) x 6 (the largest code) must stay finite; scale 255 (the
    E8M0 NaN code) never does. transformers gives the same values, and loads inf/NaN as they
    come; the first bad group is named instead."""
    blocks = torch.full((2, 3, 2, 16), 0x77, dtype=torch.uint8)        # every value 6.0
    scales = torch.full((2, 3, 2), 127, dtype=torch.uint8)
    scales[1, 2, 1] = scale
    if ok:
        got = dequantize_experts(blocks, scales, dtype, "down_proj")
        want = transformers_mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(got, want) and torch.isfinite(got).all()
        return
    with pytest.raises(ValueError, match=rf"down_proj: MXFP4 scale {scale} \(expert 1, row 2, "
                                         r"group 1\) gives non-finite"):
        dequantize_experts(blocks, scales, dtype, "down_proj")
