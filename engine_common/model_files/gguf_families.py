"""The family-specific part of a GGUF file's config.json: what llama.cpp's converter
(convert_hf_to_gguf.py) wrote for each architecture, read back into the keys of the Hugging Face
config class, torch-free. gguf_config.py builds the fields every family shares (sizes, heads,
vocabulary, rope base, tied head, special ids) and then asks FAMILIES[arch] for the rest.

    GGUF arch    Hugging Face class       read here
    llama        LlamaForCausalLM         rms eps; attention.sliding_window > 0 (a Mistral
                                          file that carries one): MistralForCausalLM with it
    qwen2/qwen3  Qwen2/Qwen3ForCausalLM   rms eps
    gemma        GemmaForCausalLM         rms eps, head width (key_length), gelu-tanh
    gemma2       Gemma2ForCausalLM        + sliding_window, both softcaps (absent: 50 / 30,
                                          llama.cpp's and Gemma2Config's defaults), attention
                                          scale as llama.cpp picks it (below)
    gemma3       Gemma3ForCausalLM        + sliding_window (absent or 0: every layer full, as
                                          llama.cpp), every 6th layer full, the sliding layers'
                                          rope base 10000, a linear rope scaling on the full
                                          layers, final softcap when present
    phi3         Phi3ForCausalLM          rms eps, sliding_window (0: none: Phi-4),
                                          partial_rotary_factor from rope.dimension_count
    starcoder2   Starcoder2ForCausalLM    layer_norm_epsilon, use_bias from the q bias, gelu-tanh

Gemma's attention scale: llama.cpp uses 1/sqrt(key_length) except for the 27B models (Gemma 2
with 46 layers, Gemma 3 with 62), which use 1/sqrt(hidden / heads): query_pre_attn_scalar is
set to match (transformers' GGUF loader leaves Gemma2Config's 256, right for 2B/9B only).
The norm weights llama.cpp stored with Gemma's +1 folded in are undone as they load
(worker_service/models/gguf_weights.py).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from engine_common.model_files.gguf_file import GGUFError, GGUFFile
from engine_common.model_files.gguf_values import metadata_float, metadata_int

GELU_TANH = "gelu_pytorch_tanh"
# llama.cpp's model-size guess for the Gemma 27B models (layer count), whose attention scale
# is 1/sqrt(hidden / heads)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_PATTERN = 6                 # llama.cpp's set_swa_pattern(6): every 6th layer full
_GEMMA3_LOCAL_THETA = 10000.0       # llama.cpp's rope_freq_base_train_swa for Gemma 3
_GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def _rms_eps(gguf: GGUFFile, arch: str, config: dict) -> dict:
    return {"rms_norm_eps": metadata_float(gguf, f"{arch}.attention.layer_norm_rms_epsilon")}


def _window(gguf: GGUFFile, arch: str) -> int:
    """attention.sliding_window as an int (absent: 0)."""
    return metadata_int(gguf, f"{arch}.attention.sliding_window", 0)


def _llama(gguf: GGUFFile, arch: str, config: dict) -> dict:
    """A Llama-layout file; one that carries a sliding window is served as Mistral with it
    (transformers instead guesses Mistral from general.name and takes MistralConfig's 4096)."""
    out = _rms_eps(gguf, arch, config)
    window = _window(gguf, arch)
    if window:
        out.update(architectures=["MistralForCausalLM"], model_type="mistral",
                   sliding_window=window)
    return out


def _gemma_scale(gguf: GGUFFile, arch: str, config: dict) -> float:
    if config["num_hidden_layers"] == _GEMMA_27B_LAYERS.get(arch):
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma(gguf: GGUFFile, arch: str, config: dict) -> dict:
    return {**_rms_eps(gguf, arch, config), "hidden_act": GELU_TANH}


def _gemma2(gguf: GGUFFile, arch: str, config: dict) -> dict:
    out = {**_rms_eps(gguf, arch, config), "hidden_activation": GELU_TANH,
           "hidden_act": GELU_TANH, "query_pre_attn_scalar": _gemma_scale(gguf, arch, config),
           "sliding_window": metadata_int(gguf, f"{arch}.attention.sliding_window",
                                          minimum=1)}
    for key, default in _GEMMA2_SOFTCAPS.items():
        out[key] = metadata_float(gguf, f"{arch}.{key}", default)
    return out


def _gemma3(gguf: GGUFFile, arch: str, config: dict) -> dict:
    """Gemma 3 text: its rope is per layer type, so the common rope_parameters give way to
    Gemma3TextConfig's rope_theta / rope_local_base_freq / rope_scaling."""
    window = _window(gguf, arch)
    layers = config["num_hidden_layers"]
    types = ["sliding_attention" if window and (i + 1) % _GEMMA3_PATTERN else "full_attention"
             for i in range(layers)]
    rope = config.pop("rope_parameters")
    out = {**_rms_eps(gguf, arch, config), "hidden_activation": GELU_TANH,
           "hidden_act": GELU_TANH, "query_pre_attn_scalar": _gemma_scale(gguf, arch, config),
           "layer_types": types,
           "sliding_window": window or None, "rope_local_base_freq": _GEMMA3_LOCAL_THETA,
           "rope_theta": rope["rope_theta"], "final_logit_softcapping":
           metadata_float(gguf, f"{arch}.final_logit_softcapping", None)}
    if rope["rope_type"] != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _phi3(gguf: GGUFFile, arch: str, config: dict) -> dict:
    """Heads are hidden / heads wide; rope.dimension_count is the rotary part (Phi-4-mini:
    0.75 of the head). LongRoPE factors (the 128k models) are refused by name."""
    longrope = [t for t in _LONGROPE_TENSORS if t in gguf.tensors]
    if longrope:
        raise GGUFError(f"{gguf.path}: {longrope[0]} (Phi-3 LongRoPE) is not read from GGUF "
                        "files: serve the Hugging Face checkpoint (Phi3ForCausalLM) instead")
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    out = {**_rms_eps(gguf, arch, config), "head_dim": head_dim,
           "sliding_window": _window(gguf, arch) or None}
    key = f"{arch}.rope.dimension_count"
    rotary = metadata_int(gguf, key, head_dim, minimum=2)
    if rotary > head_dim or rotary % 2:
        raise GGUFError(f"{gguf.path}: metadata {key}={rotary} is invalid: must be an even "
                        f"number of dims in [2, {head_dim}] (hidden / heads)")
    if rotary != head_dim:
        out["rope_parameters"] = {**config["rope_parameters"],
                                  "partial_rotary_factor": rotary / head_dim}
    return out


def _starcoder2(gguf: GGUFFile, arch: str, config: dict) -> dict:
    window = _window(gguf, arch)
    return {"norm_epsilon": metadata_float(gguf, f"{arch}.attention.layer_norm_epsilon"),
            "use_bias": "blk.0.attn_q.bias" in gguf.tensors, "hidden_act": GELU_TANH,
            "head_dim": config["hidden_size"] // config["num_attention_heads"],
            "sliding_window": window or None}


# GGUF general.architecture -> (HF architectures[0], model_type, family reader)
FAMILIES: MappingProxyType[str, tuple[str, str, Callable[[GGUFFile, str, dict], dict]]] = \
    MappingProxyType({
        "llama": ("LlamaForCausalLM", "llama", _llama),
        "qwen2": ("Qwen2ForCausalLM", "qwen2", _rms_eps),
        "qwen3": ("Qwen3ForCausalLM", "qwen3", _rms_eps),
        "gemma": ("GemmaForCausalLM", "gemma", _gemma),
        "gemma2": ("Gemma2ForCausalLM", "gemma2", _gemma2),
        "gemma3": ("Gemma3ForCausalLM", "gemma3_text", _gemma3),
        "phi3": ("Phi3ForCausalLM", "phi3", _phi3),
        "starcoder2": ("Starcoder2ForCausalLM", "starcoder2", _starcoder2),
    })
