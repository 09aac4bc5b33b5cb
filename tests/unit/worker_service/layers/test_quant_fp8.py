"""FP8 weight dequantization (layers/quant_fp8.py) against transformers' own: Fp8Dequantize (its
load-time dequantizer, whole blocks only) bit for bit in float32 and after the one rounding to
bfloat16 / float16, and _dequantize_fp8_weight where the last block row and column are partial
(shapes not multiples of the block); per-channel and per-tensor scales (compressed-tensors);
refusals naming the tensor."""
from __future__ import annotations

import pytest
import torch

from worker_service.layers.quant_fp8 import dequantize_fp8

finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")


def random_fp8(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Every finite e4m3 byte pattern is likely among rows * cols random bytes (0x7f / 0xff,
    the NaN codes, are replaced)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    return raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_bit_for_bit_as_transformers_fp8_dequantize(dtype):
    weight = random_fp8(256, 384)
    gen = torch.Generator().manual_seed(1)
    scale = torch.rand(2, 3, generator=gen) * 1e-3 + 1e-5        # [R / 128, C / 128]
    op = finegrained.Fp8Dequantize(hf_quantizer=None)
    want = op._dequantize_one(weight, scale, output_dtype=dtype)
    got = dequantize_fp8(weight, scale, (128, 128), "w").to(dtype)
    assert got.shape == (256, 384)
    assert torch.equal(got, want)


def test_partial_edge_blocks_as_transformers():
    """300 x 200 in [128, 128] blocks: the scale grid is 3 x 2, the last block row holds 44
    rows, the last block column 72 columns; each element takes its own block's scale."""
    weight = random_fp8(300, 200, seed=2)
    scale = torch.arange(1, 7, dtype=torch.float32).reshape(3, 2) * 0.25
    want = finegrained._dequantize_fp8_weight(weight, scale, [128, 128], torch.float32)
    got = dequantize_fp8(weight, scale, (128, 128), "w")
    assert torch.equal(got, want)
    assert torch.equal(got[299, 199], weight[299, 199].float() * 1.5)      # block (2, 1)
    assert torch.equal(got[127, 128], weight[127, 128].float() * 0.5)      # block (0, 1)
    assert torch.equal(got[128, 127], weight[128, 127].float() * 0.75)     # block (1, 0)


def test_per_channel_and_per_tensor_scales():
    weight = random_fp8(8, 24, seed=3)
    rows = torch.linspace(0.5, 4.0, 8, dtype=torch.bfloat16).reshape(8, 1)
    assert torch.equal(dequantize_fp8(weight, rows, None, "w"), weight.float() * rows.float())
    assert torch.equal(dequantize_fp8(weight, rows.reshape(8), None, "w"),
                       weight.float() * rows.float())
    for one in (torch.tensor(0.125), torch.tensor([0.125])):
        assert torch.equal(dequantize_fp8(weight, one, None, "w"), weight.float() * 0.125)
    # DeepSeek-V3.1's ue8m0 scales: powers of two, here stored as float8_e8m0fnu
    e8m0 = torch.tensor([[0.5, 4.0]]).to(torch.float8_e8m0fnu)
    assert torch.equal(dequantize_fp8(weight, e8m0, (8, 12), "w"),
                       weight.float() * torch.tensor([0.5] * 12 + [4.0] * 12))


@pytest.mark.parametrize("weight,scale,block,match", [
    (torch.zeros(4, 4, dtype=torch.float8_e5m2), torch.ones(1, 1), (4, 4),
     r"m\.weight: FP8 weight dtype torch\.float8_e5m2 is not supported: only "
     r"torch\.float8_e4m3fn"),
    (torch.zeros(300, 200).to(torch.float8_e4m3fn), torch.ones(2, 2), (128, 128),
     r"m\.weight: FP8 block scale shape \(2, 2\) does not fit weight \(300, 200\) in blocks "
     r"\[128, 128\]: must be \(3, 2\)"),
    (torch.zeros(6, 4).to(torch.float8_e4m3fn), torch.ones(5, 1), None,
     r"m\.weight: FP8 scale shape \(5, 1\) does not fit 6 rows"),
    (torch.full((2, 2), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn), torch.ones(1, 1),
     (2, 2), r"m\.weight: FP8 weight dequantizes to non-finite values"),
    (torch.ones(2, 2).to(torch.float8_e4m3fn), torch.tensor([[float("inf")]]), (2, 2),
     r"non-finite"),
    (torch.ones(2, 2).to(torch.float8_e4m3fn), torch.tensor([[127]], dtype=torch.uint8), (2, 2),
     r"m\.weight: FP8 scale dtype torch\.uint8 is not supported: only floating scales"),
])
def test_refusals_name_the_tensor(weight, scale, block, match):
    with pytest.raises(ValueError, match=match):
        dequantize_fp8(weight, scale, block, "m.weight")


@pytest.mark.parametrize("block", [(4, 4), None])
@pytest.mark.parametrize("where", ["code", "nan scale", "-inf scale"])
def test_one_non_finite_value_among_many_is_refused(block, where):
    """A single NaN code, or one block's (one row's) NaN / -inf scale, in an otherwise finite
    weight: the min / max check sees it as isfinite did."""
    weight = torch.ones(12, 12).to(torch.float8_e4m3fn)
    scale = torch.ones(3, 3) if block else torch.ones(12, 1)
    if where == "code":
        weight.view(torch.uint8)[7, 9] = 0xFF                  # e4m3fn's negative NaN
    else:
        scale[1, 0 if block is None else 2] = float("nan" if where == "nan scale" else "-inf")
    with pytest.raises(ValueError, match=r"^m\.weight: FP8 weight dequantizes to non-finite"):
        dequantize_fp8(weight, scale, block, "m.weight")


@pytest.mark.parametrize("shape,block", [((5, 300), (128, 128)), ((300, 5), (128, 128)),
                                         ((3, 4), (128, 128)), ((256, 256), (128, 128)),
                                         ((576, 200), (128, 128)), ((70, 90), (16, 32))])
def test_whole_and_partial_blocks_as_transformers(shape, block):
    """No whole block, whole blocks only, partial block rows / columns (DeepSeek-V3's
    kv_a_proj_with_mqa has 576 rows: 4.5 blocks): each part as transformers dequantizes it."""
    weight = random_fp8(*shape, seed=3)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = torch.rand(grid, generator=torch.Generator().manual_seed(4)) + 0.5
    want = finegrained._dequantize_fp8_weight(weight, scale, list(block), torch.float32)
    assert torch.equal(dequantize_fp8(weight, scale, block, "w"), want)
