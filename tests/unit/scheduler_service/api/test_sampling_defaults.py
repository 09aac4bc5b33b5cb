"""--generation-config: the sampling defaults of unset request fields, as vLLM takes them from
generation_config.json (auto), from another directory's, or from none (vllm); a temperature the
file does not set is 1 (sampling), as in vLLM and OpenAI's API."""
from __future__ import annotations

import json

import pytest

from engine_common.model_files.model_dir import ModelDirError
from engine_common.request.params import ParamError, SamplingParams
from scheduler_service.api.sampling_defaults import sampling_defaults


def _model(tmp_path, name: str, **gen) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    if gen:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **gen}))
    return str(path)


def test_a_model_without_sampling_keys_samples_at_temperature_one(tmp_path):
    assert sampling_defaults(_model(tmp_path, "plain")) == SamplingParams(temperature=1.0)
    assert sampling_defaults(_model(tmp_path, "eos-only", bos_token_id=1)) == SamplingParams(
        temperature=1.0)


def test_the_models_generation_config_sets_the_defaults(tmp_path):
    model = _model(tmp_path, "m", temperature=0.6, top_p=0.95, top_k=20, min_p=0.0,
                   repetition_penalty=1.1, do_sample=True)
    assert sampling_defaults(model) == SamplingParams(temperature=0.6, top_p=0.95, top_k=20,
                                                      repetition_penalty=1.1)
    assert sampling_defaults(model, "vllm") == SamplingParams(temperature=1.0)
    other = _model(tmp_path, "other", temperature=0.3)
    assert sampling_defaults(model, other) == SamplingParams(temperature=0.3)


def test_a_bad_value_or_a_missing_file_is_refused_by_name(tmp_path):
    with pytest.raises(ParamError, match="generation_config.temperature"):
        sampling_defaults(_model(tmp_path, "hot", temperature=1000.0))
    with pytest.raises(ParamError, match="generation_config.top_k"):
        sampling_defaults(_model(tmp_path, "odd", top_k="many"))
    with pytest.raises(ModelDirError, match="--generation-config .*no generation_config.json"):
        sampling_defaults(_model(tmp_path, "m"), str(tmp_path / "nowhere"))
