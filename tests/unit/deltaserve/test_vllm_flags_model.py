"""vLLM flags checked against the model: -q must name the checkpoint's own quantization method
(nothing is quantized at load), refused once the model directory is found and before the worker
starts; a model whose architecture only its own code implements (config.json's auto_map, what
vLLM's --trust-remote-code would run) is refused by the worker's check naming both. And
--allowed-origins reaches the gateway as smg's --cors-allowed-origins."""
from __future__ import annotations

import json
import shutil

import pytest

from deltaserve import cli, embedded
from deltaserve.cli import build_parser
from deltaserve.openai_gateway import openai_options, smg_command
from worker_service.config import RunnerConfig
from worker_service.models.registry import UnsupportedArchitectureError
from worker_service.runner.preflight import check_runner_config


def _no_worker(*args, **kwargs):
    raise AssertionError("the worker was started")


@pytest.mark.parametrize("method", ["gptq", "fp8", "awq_marlin"])
def test_a_quantization_the_checkpoint_is_not_in_is_refused_before_the_worker_starts(
        method, tiny_models, capsys, monkeypatch):
    monkeypatch.setattr(embedded, "start_worker", _no_worker)
    model = tiny_models("qwen3")
    capsys.readouterr()                  # the fixture's own output, when it builds the model
    assert cli.main(["serve", model, "-q", method, "--openai-listen", "off",
                     "--metrics-listen", "off"]) == 2
    err = capsys.readouterr().err
    assert err == (f"deltaserve serve: error: --quantization={method!r} is invalid: must be "
                   "the checkpoint's method (its quantization_config.quant_method is None): "
                   "nothing is quantized at load\n"), err


def _with_own_code(src: str, dst, arch: str, auto_map: dict | None):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [arch]
    if auto_map is not None:
        config["auto_map"] = auto_map
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_model_only_its_own_code_implements_is_refused_naming_the_architecture(
        tiny_models, tmp_path):
    own = _with_own_code(tiny_models("qwen3"), tmp_path / "own", "MyModelForCausalLM",
                         {"AutoModelForCausalLM": "modeling_my.MyModelForCausalLM"})
    with pytest.raises(UnsupportedArchitectureError) as refused:
        check_runner_config(RunnerConfig(model_dir=str(own), device="cpu"))
    message = str(refused.value)
    assert message.startswith("architecture='MyModelForCausalLM' is not supported (config."
                              "json's auto_map names the checkpoint's own code for it, which "
                              "DeltaServe never runs, --trust-remote-code or not): must be one "
                              "of ("), message


def test_a_served_architecture_with_an_auto_map_loads_as_without_it(tiny_models, tmp_path):
    """Checkpoints often keep an auto_map for their own classes: ours implement them."""
    own = _with_own_code(tiny_models("qwen3"), tmp_path / "own", "Qwen3ForCausalLM",
                         {"AutoModelForCausalLM": "modeling_qwen3.Qwen3ForCausalLM"})
    info = check_runner_config(RunnerConfig(model_dir=str(own), device="cpu"))
    assert info.architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize("origins,expected", [
    ('["https://ui.example", "http://localhost:3000"]',
     ["https://ui.example", "http://localhost:3000"]),
    ('["https://ui.example", "*"]', ["*"]),        # smg takes "*" only alone
    ("[]", None),
])
def test_allowed_origins_reach_the_gateway_as_cors_allowed_origins(origins, expected):
    options, _ = openai_options(build_parser().parse_args(
        ["serve", "--allowed-origins", origins]))
    cmd = smg_command("/bin/smg", options, "h:1", "/m", 1)
    if expected is None:
        assert "--cors-allowed-origins" not in cmd
    else:
        at = cmd.index("--cors-allowed-origins")
        assert cmd[at + 1:] == expected
