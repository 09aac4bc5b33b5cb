"""Reading a GGUF file (llama.cpp's single-file model format): header, metadata, tensor table.

Torch-free (struct + numpy): the scheduler reads the config and tokenizer from the metadata, the
worker dequantizes the tensors (worker_service/models/gguf_dequant.py).

File layout (little-endian; GGUF v2 and v3):

    "GGUF" | u32 version | u64 num_tensors | u64 num_kv
    num_kv x   (string key, u32 value_type, value)
    num_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset

    string = u64 length + UTF-8 bytes;  array value = u32 element_type, u64 count, elements

A tensor's `ne` lists its dimensions fastest-varying first, so its numpy/torch shape is `ne`
reversed: ne [576, 1536] is a [1536, 576] matrix of 1536 rows. Quantized types pack each row as
consecutive blocks (e.g. Q4_1: 32 values in 20 bytes).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
SUFFIX = ".gguf"

# ggml type id -> (name, values per block, bytes per block); ggml.h's table.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}

# metadata value type id -> struct format of a scalar (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF this engine can read, or lacks what is asked of it."""


def ggml_type_name(type_id: int) -> str:
    entry = GGML_TYPES.get(type_id)
    return entry[0] if entry else f"unknown ggml type {type_id}"


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table. `shape` is numpy order (ne reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int          # absolute byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)


class _Cursor:
    """Sequential little-endian reads over a buffer."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError(f"{self.path}: truncated header at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        if len(raw) != n:
            raise GGUFError(f"{self.path}: truncated string at byte {self.pos}")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int):
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            return self.array()
        raise GGUFError(f"{self.path}: metadata value type {type_id} at byte {self.pos} is "
                        f"invalid: must be one of {sorted(_SCALARS) + [_STRING, _ARRAY]}")

    def array(self) -> list:
        elem_type, n = self.scalar("<I"), self.scalar("<Q")
        if elem_type in _NUMPY:     # numbers: one numpy read instead of n struct calls
            arr = np.frombuffer(self.buf, dtype=_NUMPY[elem_type], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        return [self.value(elem_type) for _ in range(n)]


class GGUFFile:
    """A parsed GGUF header; tensor bytes are read on demand through a memory map."""

    def __init__(self, path: Path, version: int, metadata: dict, tensors: dict[str, GGUFTensor]):
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        path = Path(path)
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return cls._parse(path, buf)
        except (OSError, ValueError) as e:
            if isinstance(e, GGUFError):
                raise
            raise GGUFError(f"{path}: cannot be read as GGUF: {e}") from None

    @classmethod
    def _parse(cls, path: Path, buf) -> "GGUFFile":
        if bytes(buf[:4]) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r}, want {MAGIC!r})")
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{path}: GGUF version={version} is not supported: must be one of "
                            f"{SUPPORTED_VERSIONS} (little-endian)")
        num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        entries = [cls._tensor_entry(cur) for _ in range(num_tensors)]
        align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or align < 8 or align % 8:
            # (a string raised a bare ValueError, 0 a ZeroDivisionError)
            raise GGUFError(f"{path}: metadata general.alignment={align!r} is invalid: must be "
                            "a positive multiple of 8 (the GGUF spec)")
        data_start = -(-cur.pos // align) * align
        tensors = {}
        for name, ne, type_id, rel in entries:
            info = GGUFTensor(name, tuple(reversed(ne)), type_id, data_start + rel,
                              _nbytes(name, ne, type_id))
            if info.offset + info.nbytes > len(buf):
                raise GGUFError(f"{path}: tensor {name!r} ends past the end of the file "
                                "(truncated download?)")
            tensors[name] = info
        return cls(path, version, metadata, tensors)

    @staticmethod
    def _tensor_entry(cur: _Cursor) -> tuple[str, list[int], int, int]:
        name = cur.string()
        ne = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        return name, ne, cur.scalar("<I"), cur.scalar("<Q")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (uint8, read-only, memory-mapped)."""
        info = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset,
                         shape=(info.nbytes,))

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        """A metadata value the file must have (GGUFError naming the key otherwise)."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]


def _nbytes(name: str, ne: list[int], type_id: int) -> int:
    if type_id not in GGML_TYPES:
        return 0    # named in the error when the tensor is dequantized
    _, block, size = GGML_TYPES[type_id]
    count = int(np.prod(ne, dtype=np.int64)) if ne else 1
    if ne and ne[0] % block:
        raise GGUFError(f"tensor {name!r}: row length {ne[0]} is not a multiple of the "
                        f"{ggml_type_name(type_id)} block size {block}")
    return count // block * size


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf of a directory that has no
    config.json. None for a Hugging Face directory; GGUFError when a directory holds several."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.glob(f"*{SUFFIX}") if p.is_file())
    if len(found) > 1:
        raise GGUFError(f"{path} holds {len(found)} GGUF files "
                        f"({', '.join(p.name for p in found)}): name one with --model")
    return found[0] if found else None
