"""The dtype a checkpoint's weights are stored in, for a config.json that names none (no `dtype`
/ `torch_dtype`: openai/gpt-oss-20b's), read torch-free from a safetensors header.

transformers 5's from_pretrained (dtype "auto", its default) then takes the first floating-point
tensor of the first checkpoint file, in the file's (sorted) key order, as the model's dtype
(we skip a quantized checkpoint's scales: float32 `weight_scale_inv` is not the model's dtype);
vLLM reads the safetensors dtypes too. A safetensors file starts with the header's length
(little-endian u64), then the header: JSON {tensor name: {"dtype": "BF16", ...}, ...}.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors' floating dtypes -> torch names (float8 is skipped, as transformers skips it)
FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
MAX_HEADER_BYTES = 100 << 20       # safetensors' own limit
# a quantized checkpoint's float32 scales say nothing of the model's dtype (weight_quant.py)
SCALE_LEAVES = ("weight_scale_inv", "weight_scale", "scales", "input_scale")


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The first floating dtype among the first checkpoint file's tensors (sorted by name), as a
    torch dtype name; None without a readable safetensors checkpoint or a floating tensor."""
    first = _first_file(Path(model_dir))
    if first is None:
        return None
    try:
        with open(first, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError):
        return None
    for name in sorted(header):
        entry = header[name]
        if name != "__metadata__" and isinstance(entry, dict) \
                and entry.get("dtype") in FLOAT_DTYPES \
                and name.rpartition(".")[2] not in SCALE_LEAVES:
            return FLOAT_DTYPES[entry["dtype"]]
    return None


def _first_file(model_dir: Path) -> Path | None:
    """The first checkpoint file transformers opens: the sorted shards of the index, or the
    single file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set((json.loads(index.read_text()).get("weight_map") or {}).values()))
        except (OSError, ValueError, AttributeError):
            return None
        return model_dir / files[0] if files else None
    single = model_dir / SINGLE_FILE
    return single if single.is_file() else None
