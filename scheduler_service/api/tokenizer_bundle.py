"""The model directory's tokenizer files as one zip archive, for a gateway that cannot read the
model directory itself (VllmEngine.GetTokenizer streams it).

A GGUF model (`--model file.gguf`) has no such files: the archive then holds the ones a Hugging
Face directory would, built from the GGUF metadata exactly as the scheduler builds its own
tokenizer (tokenizer.json, tokenizer_config.json with the chat template, config.json,
generation_config.json). The archive is deterministic: files in name order, fixed timestamps and
permissions, so every replica of one model serves the same bytes and the same sha256.
"""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine_common.model_files.gguf_config import generation_config_from_gguf, hf_config_from_gguf
from engine_common.model_files.gguf_file import GGUFError, GGUFFile, find_gguf
from engine_common.model_files.gguf_tokenizer import tokenizer_config_from_gguf, tokenizer_from_gguf
from engine_common.model_files.model_dir import ModelDirError

# What a Hugging Face tokenizer (and a gateway applying its chat template) reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json",
                   "generation_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json",
                   "preprocessor_config.json", "processor_config.json")
TOKENIZER_GLOBS = ("*.jinja", "*.tiktoken")
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class TokenizerBundle:
    data: bytes
    sha256: str          # hex digest of `data`
    names: tuple[str, ...]


def tokenizer_file_names(model_dir: Path) -> list[str]:
    """The tokenizer files present in `model_dir`, sorted."""
    names = {n for n in TOKENIZER_FILES if (model_dir / n).is_file()}
    for pattern in TOKENIZER_GLOBS:
        names.update(p.name for p in model_dir.glob(pattern) if p.is_file())
    return sorted(names)


def build_tokenizer_bundle(model_dir: str | Path) -> TokenizerBundle:
    """Zip the tokenizer files of `model_dir` (a directory or a GGUF model); ModelDirError when
    it has no tokenizer."""
    files = tokenizer_files(Path(model_dir))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, files[name])
    data = buf.getvalue()
    return TokenizerBundle(data, hashlib.sha256(data).hexdigest(), tuple(sorted(files)))


def tokenizer_files(path: Path) -> dict[str, bytes]:
    """File name -> bytes of what the bundle holds."""
    try:
        gguf_path = find_gguf(path)
        if gguf_path is not None:
            return gguf_tokenizer_files(GGUFFile.open(gguf_path))
    except GGUFError as e:
        raise ModelDirError(str(e)) from None
    names = tokenizer_file_names(path)
    if "tokenizer.json" not in names:
        raise ModelDirError(f"{path / 'tokenizer.json'} not found: no tokenizer to send")
    return {name: (path / name).read_bytes() for name in names}


def gguf_tokenizer_files(gguf: GGUFFile) -> dict[str, bytes]:
    """The files a Hugging Face directory of this GGUF model would hold for its tokenizer."""
    def as_json(data: dict) -> bytes:
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()

    return {"tokenizer.json": tokenizer_from_gguf(gguf).to_str().encode(),
            "tokenizer_config.json": as_json(tokenizer_config_from_gguf(gguf)),
            "config.json": as_json(hf_config_from_gguf(gguf)),
            "generation_config.json": as_json(generation_config_from_gguf(gguf))}


def chunks(data: bytes, size: int) -> list[bytes]:
    """`data` cut into pieces of at most `size` bytes (one empty piece for empty data)."""
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]
