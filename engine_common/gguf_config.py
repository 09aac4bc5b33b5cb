"""A GGUF file's metadata as Hugging Face config.json and generation_config.json dicts.

llama.cpp writes `<arch>.<key>` metadata; transformers' GGUF loader (integrations/ggml.py) is the
reference for the mapping. Supported: the Llama family (`llama`, incl. Llama 3 and SmolLM) and
the Qwen family (`qwen2`, `qwen3`). No output.weight tensor means tied embeddings.
"""
from __future__ import annotations

from types import MappingProxyType

from engine_common.gguf_file import GGUFError, GGUFFile

# GGUF general.architecture -> (HF architectures[0], HF model_type)
ARCHITECTURES = MappingProxyType({
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
})

# GGUF key (after "<arch>.") -> HF config field; required unless in _OPTIONAL
_FIELDS = (
    ("context_length", "max_position_embeddings"),
    ("block_count", "num_hidden_layers"),
    ("feed_forward_length", "intermediate_size"),
    ("embedding_length", "hidden_size"),
    ("attention.head_count", "num_attention_heads"),
    ("attention.head_count_kv", "num_key_value_heads"),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
)
_OPTIONAL = ("attention.head_count_kv",)
_DEFAULT_ROPE_THETA = 10000.0


def gguf_architecture(gguf: GGUFFile) -> str:
    """general.architecture, checked against ARCHITECTURES."""
    arch = gguf.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf.path}: general.architecture={arch!r} is not supported: must be "
                        f"one of {sorted(ARCHITECTURES)}")
    return arch


def hf_config_from_gguf(gguf: GGUFFile) -> dict:
    """The config.json a transformers checkpoint of this model would carry (float32 weights)."""
    arch = gguf_architecture(gguf)
    hf_arch, model_type = ARCHITECTURES[arch]
    config = {"architectures": [hf_arch], "model_type": model_type}
    for key, field in _FIELDS:
        full = f"{arch}.{key}"
        if full in gguf.metadata:
            config[field] = gguf.metadata[full]
        elif key not in _OPTIONAL:
            gguf.require(full)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config["head_dim"] = _head_dim(gguf, arch, config)
    config["vocab_size"] = gguf.get(f"{arch}.vocab_size") or len(
        gguf.require("tokenizer.ggml.tokens"))
    theta = float(gguf.get(f"{arch}.rope.freq_base", _DEFAULT_ROPE_THETA))
    config["rope_theta"] = theta    # both layouts: transformers 4.x reads this one
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    config["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    config["hidden_act"] = "silu"
    config["dtype"] = "float32"
    config.update(_special_ids(gguf))
    _check_rope(gguf, arch)
    return config


def _head_dim(gguf: GGUFFile, arch: str, config: dict) -> int:
    """attention.key_length (Qwen3 writes it: its heads are not hidden/heads wide), else the rope
    dimension count, else hidden_size / heads."""
    for key in ("attention.key_length", "rope.dimension_count"):
        if f"{arch}.{key}" in gguf.metadata:
            return int(gguf.metadata[f"{arch}.{key}"])
    return config["hidden_size"] // config["num_attention_heads"]


def _check_rope(gguf: GGUFFile, arch: str) -> None:
    """Rope scaling the engine would silently get wrong is refused, naming what was found."""
    scaling = gguf.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{gguf.path}: {arch}.rope.scaling.type={scaling!r} is not supported: "
                        "must be absent or 'none'")
    if "rope_freqs.weight" in gguf.tensors:
        raise GGUFError(f"{gguf.path}: the tensor rope_freqs.weight (per-frequency rope factors, "
                        "as Llama 3.1+ files carry) is not supported")


def _special_ids(gguf: GGUFFile) -> dict:
    ids = {}
    for field, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        value = gguf.get(f"tokenizer.ggml.{key}")
        if value is not None:
            ids[field] = int(value)
    return ids


def generation_config_from_gguf(gguf: GGUFFile) -> dict:
    """bos / eos / pad ids: the file's tokenizer.ggml.*_token_id. Generation ends on every
    end-of-generation id the file names, as llama.cpp does: eos, then eot and eom (Llama 3's
    <|eot_id|> and <|eom_id|>) when present."""
    gen = _special_ids(gguf)
    ends = [gen["eos_token_id"]] if "eos_token_id" in gen else []
    for key in ("eot_token_id", "eom_token_id"):
        value = gguf.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ends:
            ends.append(int(value))
    if len(ends) > 1:
        gen["eos_token_id"] = ends
    return gen
