"""GPTQ / AWQ settings saved beside config.json instead of in it: AutoGPTQ's
`quantize_config.json` (bits, group_size, desc_act, sym, ... and no quant_method before
AutoGPTQ 0.7) and AutoAWQ's `quant_config.json` (w_bit, q_group_size, zero_point, version).
Checkpoints written by those libraries before transformers read `quantization_config` carry
only these files; vLLM reads the same two names. Without this the packed tensors would load as
if the model were plain and fail as "tensors match no parameter".

The file becomes config.json's quantization_config (in its keys) when config.json has none;
weight_quant.py then checks it as any other.
"""
from __future__ import annotations

import json
from pathlib import Path

QUANT_FILES = ("quantize_config.json", "quant_config.json")
# AutoAWQ's quant_config.json names -> AwqConfig's
AWQ_KEYS = {"w_bit": "bits", "q_group_size": "group_size", "zero_point": "zero_point",
            "version": "version", "modules_to_not_convert": "modules_to_not_convert"}


def with_quant_file(config: dict, model_dir: Path) -> dict:
    """config with quantization_config read from a file beside it when it names none; the
    config itself otherwise. ValueError naming the file when it is not a JSON object."""
    if "quantization_config" in config:
        return config
    for fname in QUANT_FILES:
        path = Path(model_dir) / fname
        if path.is_file():
            return {**config, "quantization_config": _as_quantization_config(path)}
    return config


def _as_quantization_config(path: Path) -> dict:
    try:
        quant = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(quant, dict):
        raise ValueError(f"{path} is invalid: must be a JSON object, got {quant!r}")
    if "w_bit" in quant or "q_group_size" in quant:            # AutoAWQ's names
        return {"quant_method": "awq",
                **{AWQ_KEYS.get(k, k): v for k, v in quant.items()}}
    return {"quant_method": "gptq", **quant}                  # AutoGPTQ's: the file's own wins
