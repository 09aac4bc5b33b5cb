"""GGUF tensor data -> float32 numpy arrays (numpy only: the default-model conversion uses it too).

Block layouts (ggml-common.h; d and m are float16, 32 values per block, a row is whole blocks):

    Q4_0  18 B: d, qs[16]          x[j] = d * ((qs[j] & 0xF) - 8),  x[j+16] = d * ((qs[j] >> 4) - 8)
    Q4_1  20 B: d, m, qs[16]       x[j] = d * (qs[j] & 0xF) + m,    x[j+16] = d * (qs[j] >> 4) + m
    Q8_0  34 B: d, int8 qs[32]     x[j] = d * qs[j]
    F16 / BF16 / F32: plain little-endian values (BF16 = the high 16 bits of an f32)

The arithmetic is float32 (the scales are widened first), which is what gguf-py and transformers'
GGUF loader compute, so the results are bit-identical to theirs.
"""
from __future__ import annotations

import numpy as np

from engine_common.model_files.gguf_file import GGUFError, GGUFFile, GGUFTensor, ggml_type_name

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, widened to float32, shape [n, 1]."""
    return blocks[:, start:start + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] values: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_0(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 18)
    q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return _f16(b, 0) * q.astype(np.float32)


def _q4_1(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 20)
    return _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)


def _q8_0(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 34)
    return _f16(b, 0) * b[:, 2:].copy().view(np.int8).astype(np.float32)


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f4").astype(np.float32)


def _f16_plain(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


DEQUANTIZERS = {F32: _f32, F16: _f16_plain, BF16: _bf16, Q4_0: _q4_0, Q4_1: _q4_1, Q8_0: _q8_0}


def supported_types() -> tuple[str, ...]:
    return tuple(ggml_type_name(t) for t in DEQUANTIZERS)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...],
               name: str = "tensor") -> np.ndarray:
    """float32 array of `shape` from the tensor's raw bytes; GGUFError naming an unsupported
    type (e.g. Q4_K) and the supported ones."""
    fn = DEQUANTIZERS.get(ggml_type)
    if fn is None:
        raise GGUFError(f"tensor {name!r} has type {ggml_type_name(ggml_type)}, which is not "
                        f"supported: must be one of {', '.join(supported_types())}")
    return fn(np.ascontiguousarray(raw, dtype=np.uint8)).reshape(shape)


def dequantize_tensor(gguf: GGUFFile, info: GGUFTensor) -> np.ndarray:
    """One tensor of the file as float32, numpy shape (ne reversed)."""
    return dequantize(gguf.raw(info.name), info.ggml_type, info.shape, info.name)


def check_supported(gguf: GGUFFile) -> None:
    """Fail before loading anything when a tensor's type cannot be dequantized."""
    bad = sorted({info.type_name for info in gguf.tensors.values()
                  if info.ggml_type not in DEQUANTIZERS})
    if bad:
        example = next(i.name for i in gguf.tensors.values() if i.type_name == bad[0])
        raise GGUFError(f"{gguf.path}: tensor type {', '.join(bad)} (e.g. {example!r}) is not "
                        f"supported: must be one of {', '.join(supported_types())}")
