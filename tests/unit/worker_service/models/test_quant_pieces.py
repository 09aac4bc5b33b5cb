"""models/quant_pieces.py through quant_regions.packed_shape: every piece of a quantized module
is checked against the weight's shape from the headers. A scale grid, zero or scale table, or
g_idx larger than the weight needs used to load silently (only the part a band reached was
read); each is now refused naming the tensor, its shape and the one it must have."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine_common.model_files.weight_quant import WeightQuant
from tests.support.quant_models import quantize
from worker_service.models.quant_checkpoint import CheckpointFiles
from worker_service.models.quant_regions import packed_shape

P = "m.proj"
QUANTS = {"fp8": WeightQuant("fp8", block=(16, 16)),
          "fp8-ct": WeightQuant("compressed-tensors"),
          "gptq": WeightQuant("gptq", bits=4, group_size=16, desc_act=True, zero_offset=1),
          "gptq8": WeightQuant("gptq", bits=8, group_size=16),
          "awq": WeightQuant("awq", bits=4, group_size=16)}


def pieces(fmt: str) -> dict:
    """The packed tensors of a [48, 64] weight (R 48, C 64) as the builder saves them."""
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    packed, _ = quantize(f"{P}.weight", w, fmt, torch.Generator().manual_seed(1), 16, (16, 16))
    return packed


def shape_of(tmp_path, fmt: str, tensors: dict):
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    files = CheckpointFiles({name: path for name in tensors})
    try:
        return packed_shape(files, P, QUANTS[fmt])
    finally:
        files.close()


@pytest.mark.parametrize("fmt", sorted(QUANTS))
def test_released_layouts_pass(tmp_path, fmt):
    assert shape_of(tmp_path, fmt, pieces(fmt)) == (48, 64)


def _grow(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([t, t.narrow(dim, 0, 1)], dim)


@pytest.mark.parametrize("fmt,piece,edit,want", [
    ("fp8", "weight_scale_inv", lambda t: _grow(t, 0), "must be [3, 4] (one scale per [16, 16]"),
    ("fp8", "weight_scale_inv", lambda t: t.t().contiguous(), "must be [3, 4]"),
    ("fp8", "weight_scale_inv", lambda t: t[:, :1].contiguous(), "must be [3, 4]"),
    ("fp8-ct", "weight_scale", lambda t: _grow(t, 0), "or [48, 1] (per tensor or per row"),
    ("gptq", "scales", lambda t: _grow(t, 0), "must be [4, 48] ([48, 64] in groups of 16"),
    ("gptq", "qzeros", lambda t: _grow(t, 1), "must be [4, 6]"),
    ("gptq", "g_idx", lambda t: _grow(t, 0), "must be [64] (one group index per input column)"),
    ("gptq8", "scales", lambda t: t[:1].contiguous(), "must be [4, 48]"),
    ("gptq8", "qzeros", lambda t: _grow(t, 0), "must be [4, 12]"),
    ("awq", "scales", lambda t: _grow(t, 0), "must be [4, 48]"),
    ("awq", "qzeros", lambda t: _grow(t, 1), "must be [4, 6]"),
])
def test_a_piece_of_the_wrong_shape_is_refused(tmp_path, fmt, piece, edit, want):
    tensors = pieces(fmt)
    name = f"{P}.{piece}"
    tensors[name] = edit(tensors[name])
    with pytest.raises(ValueError) as err:
        shape_of(tmp_path, fmt, tensors)
    assert str(err.value).startswith(f"{name}: shape ") and want in str(err.value), err.value


@pytest.mark.parametrize("fmt,piece,dtype,want", [
    ("fp8", "weight_scale_inv", torch.int32, "dtype I32 is not supported: only F32, BF16"),
    ("gptq", "scales", torch.int32, "dtype I32 is not supported: only F32, BF16, F16"),
    ("gptq", "qzeros", torch.int64, "dtype I64 is not supported: only I32"),
    ("awq", "qweight", torch.float32, "dtype F32 is not supported: only I32"),
])
def test_a_piece_of_the_wrong_dtype_is_refused(tmp_path, fmt, piece, dtype, want):
    tensors = pieces(fmt)
    name = f"{P}.{piece}"
    tensors[name] = tensors[name].to(dtype)
    with pytest.raises(ValueError, match=rf"^{name}: {want}"):
        shape_of(tmp_path, fmt, tensors)
