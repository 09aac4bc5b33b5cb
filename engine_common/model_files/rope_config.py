"""What config.json says about rope scaling, read without torch: the scaling fields in either
layout, the lengths a scaled rope is built from, and the longest position it covers.

Both the scheduler (max_model_len, model_dir.model_position_limit) and the worker's rotary
tables (worker_service/layers/rotary.py) read these, so the two never disagree on a length.

Lengths, as transformers and vLLM read them:
  - max_position_embeddings: config.json's key, else the architecture's transformers default
    (max_len.py's table), else vLLM's 2048;
  - the original_max_position_embeddings of YaRN, LongRoPE and llama3 (transformers'
    standardize_rope_params): a top-level key of that name wins, overwriting the rope dict's;
    a config class that defines the attribute always holds one (Phi3Config: 4096), so for its
    architecture an absent top-level key means that default, not the dict's; else the scaling
    dict's, else max_position_embeddings;
  - the longest position (vLLM's _get_and_verify_max_len): linear and dynamic scaling multiply
    the model's length by `factor`; YaRN multiplies its original length by `factor`; llama3 and
    longrope configs already state the extended length; Gemma 3's is already scaled.
"""
from __future__ import annotations

import math
from types import MappingProxyType

from engine_common.model_files.max_len import FALLBACK_MAX_LEN, arch_default_max_positions

# rope types whose `factor` stretches the model's length (vLLM: every type but su, longrope and
# llama3, whose max_position_embeddings is already the long one)
STRETCHING_TYPES = ("linear", "dynamic", "yarn")
# older spellings of a rope type (Phi-3-mini-128k's first config.json said "su"; Phi3Config and
# vLLM read it as longrope)
ROPE_TYPE_ALIASES = MappingProxyType({"su": "longrope"})
# transformers config classes with an original_max_position_embeddings attribute, by
# architecture: its default (which then wins over the rope dict's value)
ARCH_DEFAULT_ORIGINAL_POSITIONS = MappingProxyType({"Phi3ForCausalLM": 4096})


def rope_scaling_fields(config: dict) -> dict:
    """The scaling fields of whichever layout config.json uses (transformers 5's
    rope_parameters or the older rope_scaling; both set is refused: rope_layout), with
    `rope_type` set ("default" when it names none)."""
    merged = dict(rope_layout(config))
    merged["rope_type"] = canonical_rope_type(merged.get("rope_type") or merged.get("type"))
    return merged


def rope_layout(config: dict) -> dict:
    """config.json's rope dict: rope_parameters or rope_scaling (null or {}: none).

    Both set means a rope_scaling block pasted into a config transformers 5 saved (it writes
    rope_parameters only). transformers then reads rope_scaling alone and drops
    rope_parameters, its rope_theta included (the theta falls back to a top-level rope_theta
    or the config class's default; vLLM reads transformers' result): a Qwen3 config with
    rope_parameters' theta 1e6 and a pasted YaRN block would rotate with theta 1e4. Neither
    reading is what the user meant, so it is refused naming both."""
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config.json: {key}={value!r} is invalid: must be an object "
                             "or null")
    if scaling and params:
        raise ValueError(f"config.json: rope_scaling={scaling!r} and rope_parameters={params!r} "
                         "are both set: transformers reads rope_scaling alone and drops "
                         "rope_parameters (its rope_theta too): must set one (put the scaling "
                         "fields and rope_theta into rope_parameters)")
    return scaling or params or {}


def canonical_rope_type(name: str | None) -> str:
    """A rope type's name with its alias resolved ("default" for none)."""
    name = name or "default"
    return ROPE_TYPE_ALIASES.get(name, name)


def declared_max_positions(config: dict) -> int:
    """max_position_embeddings as transformers' config object holds it (absent: its class
    default for the architecture, else vLLM's fallback)."""
    value = config.get("max_position_embeddings")
    if value is None:
        value = arch_default_max_positions(config) or FALLBACK_MAX_LEN
    return int(value)


def scaling_factor(scaling: dict, required: bool = True) -> float | None:
    """`factor` of a stretching rope type as a float >= 1, or a ValueError naming it. Not
    required (YaRN): an explicit null gives None (transformers' _compute_yarn_parameters then
    derives it from the lengths), while a missing key is refused, as transformers' YaRN
    validation refuses it at config load (a KeyError) and vLLM's get_rope reads it."""
    factor = scaling.get("factor")
    if factor is None and not required:
        if "factor" not in scaling:
            raise ValueError(f"config.json: {scaling['rope_type']} rope scaling has no 'factor' "
                             "key: must be set (a number >= 1, or null for "
                             "max_position_embeddings / original_max_position_embeddings, as "
                             "transformers reads it; transformers refuses the config without "
                             "the key)")
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ValueError(f"config.json: {scaling['rope_type']} rope scaling factor={factor!r} "
                         "is invalid: must be a number >= 1")
    return float(factor)


def original_length(config: dict, scaling: dict, rope_type: str) -> int | float:
    """The pre-training length of a yarn, longrope or llama3 rope (see the module docstring
    for which key wins): a positive integer; llama3's may be any positive number (its formula
    only divides by it, and a GGUF's rope_freqs solve to a fractional one)."""
    value = config.get("original_max_position_embeddings")
    if value is None:
        archs = config.get("architectures") or [None]
        value = ARCH_DEFAULT_ORIGINAL_POSITIONS.get(archs[0])
    if value is None:
        value = scaling.get("original_max_position_embeddings")
    if value is None:
        value = declared_max_positions(config)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    number = (int, float) if rope_type == "llama3" else int
    if (isinstance(value, bool) or not isinstance(value, number) or not math.isfinite(value)
            or value <= 0 or (number is int and value < 1)):
        kind = "a positive number" if rope_type == "llama3" else "a positive integer"
        raise ValueError(f"config.json: {rope_type} original_max_position_embeddings={value!r} "
                         f"is invalid: must be {kind}")
    return value


def scaled_position_limit(native: int, config: dict) -> int:
    """The longest position the configured rope covers, given the model's own length."""
    scaling = rope_scaling_fields(config)
    rope_type = scaling["rope_type"]
    if rope_type not in STRETCHING_TYPES:
        return native
    if rope_type == "yarn":
        original = original_length(config, scaling, rope_type)
        factor = scaling_factor(scaling, required=False)
        return declared_max_positions(config) if factor is None else int(original * factor)
    return int(native * scaling_factor(scaling))
