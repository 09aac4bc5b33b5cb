"""The tokenizer bundle GetTokenizer streams: the tokenizer files of the model directory, the same
bytes (and sha256) every time, nothing else."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile

import pytest

from engine_common.text.chat_template import encode_chat, load_chat_template
from engine_common.model_files.model_dir import ModelDirError
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.api.tokenizer_bundle import build_tokenizer_bundle, chunks


def test_bundle_holds_the_tokenizer_files_only(tmp_path):
    files = {"tokenizer.json": b'{"x": 1}', "tokenizer_config.json": b"{}",
             "config.json": b'{"a": 2}', "chat_template.jinja": b"{{ messages }}",
             "model.safetensors": b"weights", "notes.txt": b"no"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    bundle = build_tokenizer_bundle(tmp_path)
    assert bundle.sha256 == hashlib.sha256(bundle.data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as zf:
        assert sorted(zf.namelist()) == ["chat_template.jinja", "config.json",
                                         "tokenizer.json", "tokenizer_config.json"]
        assert all(zf.read(n) == files[n] for n in zf.namelist())
    assert bundle.names == tuple(sorted(zf.namelist()))


def test_bundle_bytes_are_deterministic(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    first = build_tokenizer_bundle(tmp_path)
    (tmp_path / "tokenizer.json").touch()          # a newer mtime changes nothing
    assert build_tokenizer_bundle(tmp_path) == first


def test_a_directory_without_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelDirError, match="tokenizer.json"):
        build_tokenizer_bundle(tmp_path)


def test_a_gguf_model_gets_the_files_a_directory_would_hold(tiny_models, tmp_path):
    """What the scheduler builds from the GGUF metadata, as files: a Hugging Face tokenizer
    loaded from them tokenizes like the scheduler's own, chat template included."""
    gguf_files = pytest.importorskip("tests.support.gguf_files")
    template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    model = gguf_files.write_gguf(tmp_path / "tiny.gguf", tiny_models("qwen3"),
                                  chat_template=template)
    bundle = build_tokenizer_bundle(model)
    assert bundle == build_tokenizer_bundle(model)
    assert bundle.names == ("config.json", "generation_config.json", "tokenizer.json",
                            "tokenizer_config.json")
    out = tmp_path / "unzipped"
    with zipfile.ZipFile(io.BytesIO(bundle.data)) as zf:
        zf.extractall(out)
    ours, theirs = Tokenizer.from_dir(model), Tokenizer.from_dir(out)
    for text in ("Hello world, café 你好", "<|im_start|>user\nhi<|im_end|>"):
        assert theirs.encode(text) == ours.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert encode_chat(theirs, load_chat_template(out), chat) == encode_chat(
        ours, load_chat_template(model), chat)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == template
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 512


def test_chunks():
    assert chunks(b"abcde", 2) == [b"ab", b"cd", b"e"]
    assert chunks(b"", 4) == [b""]
    assert b"".join(chunks(bytes(range(256)) * 3, 100)) == bytes(range(256)) * 3
