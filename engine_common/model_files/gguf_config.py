"""A GGUF file's metadata as Hugging Face config.json and generation_config.json dicts.

llama.cpp writes `<arch>.<key>` metadata; transformers' GGUF loader (integrations/ggml.py) is the
reference for the mapping, llama.cpp's converter for what it leaves out. Supported: the Llama
family (`llama`, incl. Llama 3, SmolLM and Mistral), the Qwen family (`qwen2`, `qwen3`), Gemma
(`gemma`, `gemma2`, `gemma3` text), Phi-3 (`phi3`) and StarCoder2 (`starcoder2`); what each
family adds is gguf_families.py. No output.weight tensor means tied embeddings.
"""
from __future__ import annotations

import logging
import math
from types import MappingProxyType

import numpy as np

from engine_common.model_files.gguf_families import FAMILIES
from engine_common.model_files.gguf_file import GGUFError, GGUFFile
from engine_common.model_files.gguf_values import (MISSING, metadata_float, metadata_int,
                                                   metadata_list)

log = logging.getLogger(__name__)

# GGUF general.architecture -> (HF architectures[0], HF model_type)
ARCHITECTURES = MappingProxyType({arch: family[:2] for arch, family in FAMILIES.items()})

# GGUF key (after "<arch>.") -> HF config field; required unless in _OPTIONAL
_FIELDS = (
    ("context_length", "max_position_embeddings"),
    ("block_count", "num_hidden_layers"),
    ("feed_forward_length", "intermediate_size"),
    ("embedding_length", "hidden_size"),
    ("attention.head_count", "num_attention_heads"),
    ("attention.head_count_kv", "num_key_value_heads"),
)
_OPTIONAL = ("attention.head_count_kv",)
# GGUF architectures whose Hugging Face checkpoints are served, but not their GGUF files (MoE:
# the experts are stacked tensors the GGUF reader does not map; the others: llama.cpp's tensor
# names and norms for them are not mapped): the refusal says so
_HF_ONLY_MOE = MappingProxyType({"qwen2moe": "Qwen2MoeForCausalLM",
                                 "qwen3moe": "Qwen3MoeForCausalLM"})
_HF_ONLY = MappingProxyType({**_HF_ONLY_MOE, "smollm3": "SmolLM3ForCausalLM",
                             "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
                             "command-r": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM",
                             "glm4": "Glm4ForCausalLM", "chatglm": "GlmForCausalLM"})
_DEFAULT_ROPE_THETA = 10000.0


def gguf_architecture(gguf: GGUFFile) -> str:
    """general.architecture, checked against ARCHITECTURES."""
    arch = gguf.require("general.architecture")
    if arch not in ARCHITECTURES:
        kind = "mixture-of-experts GGUF files" if arch in _HF_ONLY_MOE else f"{arch} GGUF files"
        hint = (f"; {kind} are not read: serve the Hugging Face checkpoint ({_HF_ONLY[arch]}) "
                "instead" if arch in _HF_ONLY else "")
        raise GGUFError(f"{gguf.path}: general.architecture={arch!r} is not supported: must be "
                        f"one of {sorted(ARCHITECTURES)}{hint}")
    return arch


def hf_config_from_gguf(gguf: GGUFFile) -> dict:
    """The config.json a transformers checkpoint of this model would carry (float32 weights)."""
    arch = gguf_architecture(gguf)
    hf_arch, model_type = ARCHITECTURES[arch]
    config = {"architectures": [hf_arch], "model_type": model_type}
    for key, field in _FIELDS:
        value = metadata_int(gguf, f"{arch}.{key}", None if key in _OPTIONAL else MISSING, 1)
        if value is not None:
            config[field] = value
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config["head_dim"] = _head_dim(gguf, arch, config)
    config["vocab_size"] = metadata_int(gguf, f"{arch}.vocab_size", None, 1) or len(
        metadata_list(gguf, "tokenizer.ggml.tokens", str))
    theta = metadata_float(gguf, f"{arch}.rope.freq_base", _DEFAULT_ROPE_THETA)
    config["rope_theta"] = theta    # both layouts: transformers 4.x reads this one
    config["rope_parameters"] = _rope_parameters(gguf, arch, theta, config["head_dim"])
    config["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    config["hidden_act"] = "silu"
    config["dtype"] = "float32"
    config.update(_special_ids(gguf))
    config.update(FAMILIES[arch][2](gguf, arch, config))     # may replace any of the above
    return config


def _head_dim(gguf: GGUFFile, arch: str, config: dict) -> int:
    """attention.key_length (Qwen3 writes it: its heads are not hidden/heads wide), else the rope
    dimension count, else hidden_size / heads."""
    for key in ("attention.key_length", "rope.dimension_count"):
        if f"{arch}.{key}" in gguf.metadata:
            return metadata_int(gguf, f"{arch}.{key}", minimum=2)
    return config["hidden_size"] // config["num_attention_heads"]


def _rope_parameters(gguf: GGUFFile, arch: str, theta: float, head_dim: int) -> dict:
    """rope_parameters; rope scaling the engine would get wrong is refused by name."""
    scaling = gguf.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise GGUFError(f"{gguf.path}: {arch}.rope.scaling.type={scaling!r} is not supported: "
                        "must be absent, 'none' or 'linear'")
    if scaling == "linear":         # Gemma 3 4B+ (its full layers), linear fine-tunes
        factor = metadata_float(gguf, f"{arch}.rope.scaling.factor")
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if "rope_freqs.weight" not in gguf.tensors:
        return {"rope_type": "default", "rope_theta": theta}
    info = gguf.tensors["rope_freqs.weight"]
    if info.type_name != "F32" or info.shape != (head_dim // 2,):
        raise GGUFError(f"{gguf.path}: rope_freqs.weight is {info.type_name} {info.shape}: "
                        f"must be F32 ({head_dim // 2},)")
    factors = gguf.raw("rope_freqs.weight").view("<f4").astype(np.float64)
    return {"rope_type": "llama3", "rope_theta": theta,
            **_llama3_scaling(factors, theta, head_dim, gguf)}


def _llama3_factors(wavelen: np.ndarray, factor: float, low: float, high: float,
                    context: float) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs for Llama 3.1 rope scaling."""
    smooth = (context / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0,
                    np.where(wavelen > context / low, factor, blended))


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, gguf: GGUFFile) -> dict:
    """Llama 3.1 rope scaling (factor, low/high_freq_factor, original context) that reproduces
    the file's per-frequency factors (rope_freqs.weight, divisors of each rope frequency).

    The factors fix only the wavelength band edges (context / high, context / low), so low and
    high keep Llama 3.1's 1 and 4 and the context is solved from a factor inside the band (or
    chosen between the edges when no frequency falls inside); the result is checked against
    every factor."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor, low, high = float(factors.max()), 1.0, 4.0
    inside = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if inside.any():
        i = int(np.argmax(inside))
        smooth = (1 / factors[i] - 1 / factor) / (1 - 1 / factor)
        context = float(wavelen[i] * (low + smooth * (high - low)))
    else:
        lo = high * wavelen[factors <= 1 + 1e-6].max(initial=0.0)
        hi = low * wavelen[factors >= factor * (1 - 1e-6)].min(initial=math.inf)
        context = 8192.0 if lo < 8192.0 < hi else (lo + hi) / 2 if math.isfinite(hi) else 2 * lo
    expected = _llama3_factors(wavelen, factor, low, high, context)
    if factor <= 1 or not np.allclose(expected, factors, rtol=1e-4, atol=0):
        raise GGUFError(f"{gguf.path}: rope_freqs.weight is not Llama 3.1 rope scaling (got "
                        f"{np.round(factors, 4).tolist()}): such rope factors are not supported")
    return {"factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": round(context, 3)}


# llama.cpp's "no such token" (LLAMA_TOKEN_NULL): read as an absent id, not an error
_NO_TOKEN = -1


def _token_id(gguf: GGUFFile, key: str) -> int | None:
    """tokenizer.ggml.<key> (an integer, else GGUFError naming it); None when absent or -1, or
    past the vocabulary: such an id names no token the model reads or produces (transformers'
    GGUF tokenizer fails on tokens[id]; llama.cpp warns "bad special token" and keeps its
    vocabulary type's default id instead), so it is dropped, with one warning per process."""
    value = metadata_int(gguf, f"tokenizer.ggml.{key}", None, minimum=_NO_TOKEN)
    if value is None or value == _NO_TOKEN:
        return None
    num_tokens = len(metadata_list(gguf, "tokenizer.ggml.tokens", str, []))
    if num_tokens and value >= num_tokens:
        _warn_once(gguf, f"tokenizer.ggml.{key}={value} is past the vocabulary ({num_tokens} "
                         "tokens): dropped")
        return None
    return value


# (file, message) pairs already logged: every process reads a file's ids several times
# (config.json, generation_config.json, the tokenizer bundle)
_WARNED: set[tuple[str, str]] = set()


def _warn_once(gguf: GGUFFile, message: str) -> None:
    if (str(gguf.path), message) not in _WARNED:
        _WARNED.add((str(gguf.path), message))
        log.warning("%s: %s", gguf.path, message)


def _special_ids(gguf: GGUFFile) -> dict:
    """bos / eos / pad ids the file names within its vocabulary (config.json's fields)."""
    ids = {}
    for field, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        value = _token_id(gguf, key)
        if value is not None:
            ids[field] = value
    return ids


def generation_config_from_gguf(gguf: GGUFFile) -> dict:
    """bos / eos / pad ids: the file's tokenizer.ggml.*_token_id. Generation ends on every
    end-of-generation id the file names, as llama.cpp does: eos, then eot and eom (Llama 3's
    <|eot_id|> and <|eom_id|>) when present, each only within the vocabulary."""
    gen = _special_ids(gguf)
    ends = [gen["eos_token_id"]] if "eos_token_id" in gen else []
    for key in ("eot_token_id", "eom_token_id"):
        value = _token_id(gguf, key)
        if value is not None and value not in ends:
            ends.append(value)
    if ends:                # eot alone too (the eos absent or past the vocabulary)
        gen["eos_token_id"] = ends if len(ends) > 1 else ends[0]
    named_eos = metadata_int(gguf, "tokenizer.ggml.eos_token_id", None, minimum=_NO_TOKEN)
    if not ends and named_eos not in (None, _NO_TOKEN):     # named, but past the vocabulary
        _warn_once(gguf, "no end-of-generation id is left (its eos id is past the vocabulary, "
                         "and it names no eot/eom id): a request ends only at its max_tokens, "
                         "a stop string or the model's length")
    return gen
