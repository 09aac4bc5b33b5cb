"""The model's own maximum length from config.json, derived as vLLM derives it
(vllm/config: _get_and_verify_max_len) over the config transformers would build.

vLLM reads the length keys of the *config object*, where transformers has already filled in
the config class's defaults, and takes the smallest of those present. A config.json without
max_position_embeddings therefore does not mean 2048 for every model: it means the default of
that architecture's transformers config class (Qwen3: 32768, Gemma 2: 8192, ...). The scheduler
side imports neither torch nor transformers, so those defaults are a table here; a test
(tests/unit/engine_common/model_files/test_max_len.py) holds it to transformers' classes.
Rope scaling is applied on top, in model_dir.model_position_limit.
"""
from __future__ import annotations

from types import MappingProxyType

# The keys vLLM tries, in its order (OPT, GPT-2, MPT, ChatGLM2, Command-R, Whisper, others).
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")

# max_position_embeddings of the transformers config class of each architecture we serve
# (transformers 5.x: LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config,
# Qwen3Config, Qwen2MoeConfig, Qwen3MoeConfig, GemmaConfig, Gemma2Config, Gemma3TextConfig,
# Olmo2Config, GraniteConfig, SmolLM3Config, Starcoder2Config,
# GptOssConfig, GlmConfig, Glm4Config, CohereConfig, Cohere2Config, DeepseekV2Config,
# DeepseekV3Config).
ARCH_DEFAULT_MAX_POSITIONS = MappingProxyType({
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 131072,          # 4096 * 32
    "MixtralForCausalLM": 131072,          # 4096 * 32
    "Phi3ForCausalLM": 4096,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
    "Qwen2MoeForCausalLM": 32768,
    "Qwen3MoeForCausalLM": 32768,
    "GemmaForCausalLM": 8192,
    "Gemma2ForCausalLM": 8192,
    "Gemma3ForCausalLM": 131072,
    "Olmo2ForCausalLM": 2048,
    "GraniteForCausalLM": 2048,
    "SmolLM3ForCausalLM": 32768,
    "Starcoder2ForCausalLM": 4096,
    "GptOssForCausalLM": 131072,
    "DeepseekV2ForCausalLM": 2048,
    "DeepseekV3ForCausalLM": 4096,
    "GlmForCausalLM": 131072,
    "Glm4ForCausalLM": 131072,
    "CohereForCausalLM": 8192,
    "Cohere2ForCausalLM": 8192,
    # encoders (BertConfig, RobertaConfig, XLMRobertaConfig); RoBERTa's 512 includes the
    # pad_token_id + 1 positions it never uses (model_dir.model_position_limit)
    "BertModel": 512, "BertForMaskedLM": 512, "RobertaModel": 512, "RobertaForMaskedLM": 512,
    "XLMRobertaModel": 512, "XLMRobertaForMaskedLM": 512,
    "BertForSequenceClassification": 512, "RobertaForSequenceClassification": 512,
    "XLMRobertaForSequenceClassification": 512,
    # decoder classifiers: their causal LM's config class
    "LlamaForSequenceClassification": 2048, "Qwen2ForSequenceClassification": 32768,
    "Qwen3ForSequenceClassification": 32768,
})
# vLLM's length when no key is found at all (an architecture outside the table)
FALLBACK_MAX_LEN = 2048


class MaxLenError(ValueError):
    """A length key holds something that is not an integer."""


def arch_default_max_positions(config: dict) -> int | None:
    """The transformers default max_position_embeddings of config's architecture, or None."""
    archs = config.get("architectures") or [None]
    return ARCH_DEFAULT_MAX_POSITIONS.get(archs[0])


def derived_max_len(config: dict) -> tuple[int, str]:
    """(length, where it came from): the smallest of MAX_LEN_KEYS present in config.json, with
    max_position_embeddings defaulted to the architecture's transformers default when absent;
    with no key at all, FALLBACK_MAX_LEN. A present max_position_embeddings must be an integer
    (null too is refused); another key that is null is skipped (vLLM's getattr None)."""
    values = dict(config)
    if "max_position_embeddings" not in values:
        default = arch_default_max_positions(config)
        if default is not None:
            values["max_position_embeddings"] = default
    found = [(as_length(key, values[key]), key) for key in MAX_LEN_KEYS
             if key in values and (values[key] is not None or key == "max_position_embeddings")]
    if not found:
        return FALLBACK_MAX_LEN, "default"
    return min(found, key=lambda pair: pair[0])


def as_length(key: str, value) -> int:
    """config.json's `key` as an int, else MaxLenError naming it."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MaxLenError(f"config.json: {key}={value!r} is invalid: must be an integer")
    return value
