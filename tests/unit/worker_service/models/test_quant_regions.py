"""models/quant_regions.py and quant_checkpoint.DequantSlice: a region of a quantized weight
equals that region of the whole dequantized weight, and is read from its own packed words,
blocks and groups only (each piece's reads are recorded); slices the weight loaders do not use
are refused."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine_common.model_files.weight_quant import WeightQuant
from tests.support.quant_models import awq_pack, gptq_pack, quantize_fp8_blocks
from worker_service.models.quant_checkpoint import CheckpointFiles, DequantSlice
from worker_service.models.quant_regions import read_awq, read_fp8, read_gptq


class RecordingSlice:
    """A safetensors slice that records the keys it is read with."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, key):
        self.log.append(key)
        return self.inner[key]


class RecordingFiles(CheckpointFiles):
    def __init__(self, index) -> None:
        super().__init__(index)
        self.reads: dict[str, list] = {}

    def slice(self, name: str):
        return RecordingSlice(super().slice(name), self.reads.setdefault(name, []))

    def tensor(self, name: str):
        self.reads.setdefault(name, []).append("whole")
        return super().tensor(name)


def files_of(tmp_path, tensors: dict) -> RecordingFiles:
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return RecordingFiles({name: path for name in tensors})


def test_fp8_block_region_reads_its_blocks(tmp_path):
    gen = torch.Generator().manual_seed(0)
    weight, scale = quantize_fp8_blocks(torch.randn(40, 56, generator=gen), (16, 16))
    files = files_of(tmp_path, {"m.weight": weight, "m.weight_scale_inv": scale})
    quant = WeightQuant("fp8", block=(16, 16))
    whole = read_fp8(files, "m", quant, (40, 56), (0, 40), (0, 56))
    files.reads.clear()
    part = read_fp8(files, "m", quant, (40, 56), (16, 40), (32, 56))    # partial last blocks
    assert torch.equal(part, whole[16:40, 32:56])
    assert files.reads["m.weight"] == [(slice(16, 40), slice(32, 56))]
    assert files.reads["m.weight_scale_inv"] == [(slice(1, 3), slice(2, 4))]
    with pytest.raises(ValueError, match=r"m\.weight: rows \[8, 40\) of 40 do not fall on FP8 "
                                         r"block edges \(multiples of 16\)"):
        read_fp8(files, "m", quant, (40, 56), (8, 40), (0, 56))


def test_fp8_per_tensor_weight_scale(tmp_path):
    """quant_method fp8 without weight_block_size: one scale per tensor, under transformers'
    name (weight_scale_inv) or AutoFP8's (weight_scale)."""
    weight = torch.linspace(-3, 3, 48).reshape(6, 8).to(torch.float8_e4m3fn)
    for scale_name in ("weight_scale_inv", "weight_scale"):
        files = files_of(tmp_path, {"m.weight": weight, f"m.{scale_name}": torch.tensor(0.25)})
        got = read_fp8(files, "m", WeightQuant("fp8"), (6, 8), (2, 6), (0, 8))
        assert torch.equal(got, weight[2:6].float() * 0.25)
        files.close()


def test_gptq_region_reads_its_words_and_groups(tmp_path):
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (64, 24), generator=gen, dtype=torch.int32)     # C = 64, R = 24
    z = torch.randint(1, 17, (4, 24), generator=gen, dtype=torch.int32)
    scales = torch.rand(4, 24, generator=gen).to(torch.float16)
    qweight, qzeros = gptq_pack(q, z)
    files = files_of(tmp_path, {"m.qweight": qweight, "m.qzeros": qzeros, "m.scales": scales})
    quant = WeightQuant("gptq", bits=4, group_size=16, zero_offset=1)
    whole = read_gptq(files, "m", quant, (24, 64), (0, 24), (0, 64))
    want = ((q - z[torch.arange(64) // 16]).float() * scales.float()[torch.arange(64) // 16]).t()
    assert torch.equal(whole, want)
    files.reads.clear()
    part = read_gptq(files, "m", quant, (24, 64), (8, 16), (32, 64))
    assert torch.equal(part, whole[8:16, 32:64])
    assert files.reads["m.qweight"] == [(slice(4, 8), slice(8, 16))]         # words of 8 cols
    assert files.reads["m.qzeros"] == [(slice(2, 4), slice(1, 2))]           # groups 2, 3
    assert files.reads["m.scales"] == [(slice(2, 4), slice(8, 16))]
    with pytest.raises(ValueError, match=r"m\.qweight: rows \[4, 24\) of 24 do not fall on "
                                         r"packed zero-point word edges \(multiples of 8\)"):
        read_gptq(files, "m", quant, (24, 64), (4, 24), (0, 64))


@pytest.mark.parametrize("bad", [-1, 4])
def test_gptq_g_idx_out_of_range_is_refused(tmp_path, bad):
    q = torch.zeros(16, 8, dtype=torch.int32)
    qweight, qzeros = gptq_pack(q, torch.ones(4, 8, dtype=torch.int32))
    g_idx = torch.tensor([0, 1, 2, 3] * 3 + [0, 1, 2, bad], dtype=torch.int32)
    files = files_of(tmp_path, {"m.qweight": qweight, "m.qzeros": qzeros,
                                "m.scales": torch.ones(4, 8, dtype=torch.float16),
                                "m.g_idx": g_idx})
    quant = WeightQuant("gptq", bits=4, group_size=4, desc_act=True, zero_offset=1)
    with pytest.raises(ValueError, match=rf"m\.g_idx: group {min(bad, 0)} \.\. {max(bad, 3)} "
                                         r"out of range: the scales hold groups \[0, 4\)"):
        read_gptq(files, "m", quant, (8, 16), (0, 8), (0, 16))


def test_awq_region_reads_its_words_and_groups(tmp_path):
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (32, 24), generator=gen, dtype=torch.int32)     # C = 32, R = 24
    z = torch.randint(0, 16, (2, 24), generator=gen, dtype=torch.int32)
    scales = torch.rand(2, 24, generator=gen).to(torch.float16)
    files = files_of(tmp_path, {"m.qweight": awq_pack(q), "m.qzeros": awq_pack(z),
                                "m.scales": scales})
    quant = WeightQuant("awq", bits=4, group_size=16)
    whole = read_awq(files, "m", quant, (24, 32), (0, 24), (0, 32))
    groups = torch.arange(32) // 16
    assert torch.equal(whole, ((q - z[groups]).float() * scales.float()[groups]).t())
    files.reads.clear()
    assert torch.equal(read_awq(files, "m", quant, (24, 32), (16, 24), (16, 32)),
                       whole[16:24, 16:32])
    assert files.reads["m.qweight"] == [(slice(16, 32), slice(2, 3))]
    assert files.reads["m.qzeros"] == [(slice(1, 2), slice(2, 3))]


def test_dequant_slice_reads_as_the_weight_loaders_do():
    calls = []
    sl = DequantSlice("m.weight", (6, 4), lambda *region: calls.append(region) or region)
    assert sl.get_shape() == [6, 4]
    assert sl[2:4] == (2, 4, 0, 4) and sl[:, 1:3] == (0, 6, 1, 3) and sl[:] == (0, 6, 0, 4)
    assert sl[1:9, :2] == (1, 6, 0, 2)
    with pytest.raises(TypeError, match=r"m\.weight: slices with a step"):
        sl[::2]
    with pytest.raises(TypeError, match=r"m\.weight: a dequantized weight is read by row and "
                                        r"column slices, got 3"):
        sl[3]
