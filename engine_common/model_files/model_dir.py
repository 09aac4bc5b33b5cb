"""Reading a model: a Hugging Face directory's config.json and generation_config.json, or the same
facts from a GGUF file's metadata (`--model file.gguf`, or a directory holding one .gguf)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from engine_common.model_files.gguf_config import generation_config_from_gguf, hf_config_from_gguf
from engine_common.model_files.gguf_file import GGUFError, GGUFFile, find_gguf
from engine_common.model_files.max_len import MaxLenError, derived_max_len
from engine_common.model_files.moe_config import moe_config_problem
from engine_common.model_files.quant_config import quantization_problem
from engine_common.model_files.quant_files import with_quant_file
from engine_common.model_files.rope_config import scaled_position_limit

# The shortest request, a prompt token and an output token: engine_common/request/diff_limits.py's
# MIN_MODEL_LEN, repeated because this room imports nothing of ours (tests/test_layers.py).
MIN_MODEL_LEN = 2


class ModelDirError(ValueError):
    """The directory is not a usable model directory."""


def load_json(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ModelDirError(f"{path} not found") from None
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{path} is not valid JSON: {e}") from None


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelInfo:
    """What the scheduler needs to know about a model; no weights are read."""

    path: str
    name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    hf_config: dict

    @classmethod
    def from_dir(cls, model_dir: str | Path, max_model_len: int | None = None) -> "ModelInfo":
        path = Path(model_dir)
        if not path.exists():
            raise ModelDirError(f"model directory {str(path)!r} does not exist")
        config, gen, name = read_model_configs(path)
        archs = config.get("architectures") or []
        if not archs:
            raise ModelDirError(f"{path / 'config.json'} names no architectures")
        problem = moe_config_problem(config) or quantization_problem(config)
        if problem is not None:
            raise ModelDirError(f"{path / 'config.json'}: {problem}")
        eos = _as_tuple(gen.get("eos_token_id", config.get("eos_token_id")))
        native_len = model_position_limit(config)
        _check_model_len(max_model_len, native_len)
        return cls(path=str(path), name=name, architecture=archs[0],
                   vocab_size=int(config["vocab_size"]),
                   max_model_len=max_model_len or native_len,
                   eos_token_ids=eos, hf_config=config)


    def with_tokenizer_eos(self, eos_token_id: int | None) -> "ModelInfo":
        """This model with its tokenizer's eos among the ids that end generation: vLLM stops
        at the tokenizer's eos whatever generation_config.json names (a chat fine-tune's
        tokenizer often ends turns with <|im_end|> while its generation config keeps the
        base model's </s>)."""
        if eos_token_id is None or eos_token_id in self.eos_token_ids:
            return self
        return dataclasses.replace(self, eos_token_ids=self.eos_token_ids + (eos_token_id,))


# RoBERTa-style encoders number positions from pad_token_id + 1: that many fewer tokens fit.
_PADDED_POSITIONS = frozenset({"roberta", "xlm-roberta"})


def model_position_limit(config: dict) -> int:
    """The longest sequence the model's rope covers: its length (max_len.py: the smallest length
    key, absent ones at the architecture's transformers default, as vLLM), stretched by a
    linear, dynamic or YaRN rope scaling factor as vLLM stretches it (rope_config.py): a
    Vicuna-v1.5-16k config says 4096 with linear factor 4 and was tuned to 16384; a Qwen2.5
    config with YaRN factor 4 over 32768 original positions serves 131072. Llama 3 and
    LongRoPE configs already state the extended length (vLLM agrees). The rotary tables
    (worker_service/layers/rotary.py) are this long."""
    try:
        native, _ = derived_max_len(config)
    except MaxLenError as e:
        raise ModelDirError(str(e)) from None
    if config.get("model_type") in _PADDED_POSITIONS:     # positions start at pad + 1 (vLLM)
        pad = config.get("pad_token_id")
        return native - (1 if pad is None else int(pad)) - 1
    if "gemma3" in str(config.get("model_type", "")):
        return native      # its max_position_embeddings is already the scaled one (as vLLM)
    try:
        return scaled_position_limit(native, config)
    except ValueError as e:
        raise ModelDirError(str(e)) from None


def _check_model_len(max_model_len: int | None, native_len: int) -> None:
    """ModelDirError naming the value and the range. No override past the model's length
    (vLLM has one, VLLM_ALLOW_LONG_MAX_MODEL_LEN): the rotary tables stop there."""
    if native_len < MIN_MODEL_LEN:
        raise ModelDirError(f"max_position_embeddings={native_len} is invalid: must be at least "
                            f"{MIN_MODEL_LEN} (a prompt token and an output token)")
    allowed = f"must be in [{MIN_MODEL_LEN}, {native_len}]"
    if max_model_len is not None and max_model_len > native_len:
        raise ModelDirError(f"max_model_len={max_model_len} exceeds the model's "
                            f"max_position_embeddings ({native_len}, stretched by a rope "
                            f"scaling factor if any): {allowed}")
    if max_model_len is not None and max_model_len < MIN_MODEL_LEN:
        raise ModelDirError(f"max_model_len={max_model_len} is invalid: {allowed} (a prompt "
                            "token and an output token)")


def read_model_configs(path: Path) -> tuple[dict, dict, str]:
    """(config.json, generation_config.json, model name) of a directory or a GGUF file."""
    try:
        gguf_path = find_gguf(path)
        if gguf_path is not None:
            gguf = GGUFFile.open(gguf_path)
            return hf_config_from_gguf(gguf), generation_config_from_gguf(gguf), gguf_path.stem
    except GGUFError as e:
        raise ModelDirError(str(e)) from None
    if not path.is_dir():
        raise ModelDirError(f"{str(path)!r} is neither a model directory nor a .gguf file")
    gen_path = path / "generation_config.json"
    gen = load_json(gen_path) if gen_path.exists() else {}
    try:                      # GPTQ / AWQ settings in a file beside config.json
        config = with_quant_file(load_json(path / "config.json"), path)
    except ValueError as e:
        raise ModelDirError(str(e)) from None
    return config, gen, path.name
