"""Dequantization equals gguf-py's (llama.cpp's reference Python) bit for bit, for every type
the engine supports; any other type is refused by name."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine_common.model_files.gguf_file import GGUFError, GGUFFile
from worker_service.models.gguf_dequant import (DEQUANTIZERS, check_supported, dequantize,
                                                supported_types)

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"]


def _data(rows: int = 6, cols: int = 96) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 3
    x[0, :32] = 0.0                      # an all-zero block (scale 0)
    x[1, :32] = 5.0                      # a constant block
    return x


@pytest.mark.parametrize("name", TYPES)
def test_bit_identical_to_gguf_py(name):
    qtype = gguf.GGMLQuantizationType[name]
    packed = gguf.quants.quantize(_data(), qtype)
    raw = np.frombuffer(packed.tobytes(), dtype=np.uint8)
    got = dequantize(raw, int(qtype), (6, 96), "w")
    want = gguf.quants.dequantize(packed, qtype).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == (6, 96)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, tolerance", [("F32", 0), ("F16", 2e-3), ("BF16", 2e-2),
                                             ("Q8_0", 3e-2), ("Q4_1", 0.6), ("Q4_0", 1.2)])
def test_close_to_the_original_values(name, tolerance):
    """A sanity bound on each format's rounding (not a property of our code alone)."""
    qtype = gguf.GGMLQuantizationType[name]
    raw = np.frombuffer(gguf.quants.quantize(_data(), qtype).tobytes(), dtype=np.uint8)
    err = np.abs(dequantize(raw, int(qtype), (6, 96)) - _data())
    assert err.max() <= tolerance * np.abs(_data()).max() / 3


def test_an_unsupported_type_is_named():
    with pytest.raises(GGUFError, match="tensor 'blk.0.attn_q.weight' has type Q4_K, which is "
                                        "not supported: must be one of F32, F16, BF16, Q4_0, "
                                        "Q4_1, Q8_0"):
        dequantize(np.zeros(144, dtype=np.uint8), 12, (256,), "blk.0.attn_q.weight")
    assert supported_types() == ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
    assert len(DEQUANTIZERS) == len(TYPES)


def test_a_file_with_an_unsupported_type_is_refused_before_loading(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((2, 32), dtype=np.float32))
    # two rows of one Q6_K block each (256 values in 210 bytes); the bytes do not matter
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((2, 210), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="tensor type Q6_K \\(e.g. 'blk.0.ffn_up.weight'\\) is "
                                        "not supported"):
        check_supported(GGUFFile.open(tmp_path / "k.gguf"))
