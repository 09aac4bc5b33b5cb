"""`deltaserve serve --model` refuses a mixture-of-experts model it cannot serve, with exit code
2 and a message naming the numbers (or the architecture), never a traceback:

  - a tensor-parallel size that does not divide moe_intermediate_size, or num_key_value_heads,
    before any process starts,
  - a MoE GGUF file (llama.cpp's qwen3moe/qwen2moe: stacked expert tensors), naming its
    general.architecture and the Hugging Face checkpoint that would serve,
  - num_experts_per_tok outside [1, num_experts], or moe_intermediate_size 0, in config.json:
    refused when the model directory is read, before the worker starts, naming the field, its
    value and the allowed range.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.grpc_harness import REPO, SMALL_KV_GIB, child_env, free_port


def serve(model: str, *flags: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--model", model,
           "--listen", f"127.0.0.1:{free_port()}", "--worker-listen",
           f"127.0.0.1:{free_port()}", "--device", "cpu", "--kv-cache-gib", SMALL_KV_GIB,
           "--metrics-listen", "127.0.0.1:0", "--openai-listen", "off", *flags]
    # a server that did not refuse would run into this timeout (TimeoutExpired fails the test)
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(None), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert "DeltaServe ready" not in out, out
    return proc.returncode, out


@pytest.mark.parametrize("overrides, why", [
    ({"moe_intermediate_size": 33},
     "--local-ranks=2 is invalid: must be a tensor-parallel size this model can be split over: "
     "1 (2 does not divide moe_intermediate_size=33;"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3},
     "--local-ranks=2 is invalid: must be a tensor-parallel size this model can be split over: "
     "1 (2 neither divides num_key_value_heads=3 nor is a multiple of it;"),
], ids=["moe_intermediate_size", "kv_heads"])
def test_a_tp_size_the_experts_or_kv_heads_cannot_split_is_refused(tiny_models, overrides, why):
    code, out = serve(tiny_models("qwen3_moe", **overrides), "--local-ranks", "2")
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"deltaserve serve: error: {why}"), out


@pytest.mark.parametrize("arch, gguf_arch, hf_arch", [
    ("qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM"),
    ("qwen2_moe", "qwen2moe", "Qwen2MoeForCausalLM")])
def test_a_moe_gguf_file_is_refused_naming_its_architecture(tiny_models, tmp_path, arch,
                                                            gguf_arch, hf_arch):
    from engine_common.model_files.gguf_config import ARCHITECTURES
    from tests.support.gguf_files import write_gguf
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_models(arch))
    code, out = serve(str(path))
    assert code == 2, out
    assert "qwen2" in ARCHITECTURES and gguf_arch not in ARCHITECTURES
    assert out.strip() == (
        f"deltaserve serve: error: {path}: general.architecture={gguf_arch!r} is not supported: "
        f"must be one of {sorted(ARCHITECTURES)}; mixture-of-experts GGUF files are not "
        f"read: serve the Hugging Face checkpoint ({hf_arch}) instead"), out


@pytest.mark.parametrize("field, value, why", [
    ("num_experts_per_tok", 9, "num_experts_per_tok=9 is invalid: must be in "
                               "[1, num_local_experts=8]"),
    ("num_experts_per_tok", 0, "num_experts_per_tok=0 is invalid: must be in "
                               "[1, num_local_experts=8]"),
    ("moe_intermediate_size", 0, "moe_intermediate_size=0 is invalid: must be >= 1"),
])
def test_an_impossible_moe_config_is_refused_before_the_worker_starts(tiny_models, tmp_path,
                                                                       field, value, why):
    model = Path(shutil.copytree(tiny_models("qwen3_moe"), tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    # transformers 5 writes num_local_experts (Hub checkpoints: num_experts)
    assert config["num_local_experts"] == 8
    config[field] = value
    (model / "config.json").write_text(json.dumps(config))
    code, out = serve(str(model))
    assert code == 2, out
    assert out.strip() == f"deltaserve serve: error: {model / 'config.json'}: {why}", out
