"""The sampling defaults a request's unset fields take, as vLLM sets them (--generation-config):
`auto` reads the model's generation_config.json (or a GGUF file's metadata), a directory path
reads that directory's generation_config.json, and `vllm` reads none. A key the file does not
set takes vLLM's default: temperature 1 (sampling, as OpenAI's API), the rest off.
"""
from __future__ import annotations

from pathlib import Path

from engine_common.model_files.model_dir import ModelDirError, load_json, read_model_configs
from engine_common.request.params import KNOBS, ParamError, SamplingParams

AUTO, VLLM = "auto", "vllm"
# generation_config.json keys vLLM takes as sampling defaults (max_new_tokens aside).
_KEYS = {k.name: int if k.meta.integer else float for k in KNOBS if k.meta.generation_config}
_UNSET_TEMPERATURE = 1.0


def sampling_defaults(model_dir: str, generation_config: str = AUTO) -> SamplingParams:
    """The defaults for `model_dir` under --generation-config `generation_config`; ParamError
    names the flag when its file holds a value out of range."""
    gen = _generation_config(model_dir, generation_config)
    values = {"temperature": _UNSET_TEMPERATURE}
    for key, kind in _KEYS.items():
        if gen.get(key) is not None:
            try:
                values[key] = kind(gen[key])
            except (TypeError, ValueError):
                raise ParamError(f"generation_config.{key}", gen[key], f"a {kind.__name__}")
    try:
        return SamplingParams(**values)
    except ParamError as e:
        raise ParamError(f"generation_config.{e.field}", e.value, e.allowed) from None


def _generation_config(model_dir: str, generation_config: str) -> dict:
    if generation_config == VLLM:
        return {}
    if generation_config == AUTO:
        return read_model_configs(Path(model_dir))[1]
    path = Path(generation_config) / "generation_config.json"
    if not path.is_file():
        raise ModelDirError(f"--generation-config {generation_config}: no {path.name} there "
                            f"(auto: the model's; vllm: none)")
    return load_json(path)
