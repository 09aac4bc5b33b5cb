"""The model's max length when config.json lacks max_position_embeddings, derived as vLLM does
(the smallest of its length keys over the config transformers builds): each architecture's
transformers default, not 2048 for all; the other keys in vLLM's list; rope scaling on top; and
the worker's rope table as long as the scheduler's length."""
from __future__ import annotations

import json

import pytest

from engine_common.model_files.max_len import (ARCH_DEFAULT_MAX_POSITIONS, FALLBACK_MAX_LEN,
                                               derived_max_len)
from engine_common.model_files.model_dir import ModelDirError, ModelInfo


def _model_dir(tmp_path, arch="LlamaForCausalLM", **fields):
    config = {"architectures": [arch], "vocab_size": 32, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_table_is_transformers_config_class_defaults():
    transformers = pytest.importorskip("transformers")
    from worker_service.models.registry import MODEL_REGISTRY
    assert set(ARCH_DEFAULT_MAX_POSITIONS) == set(MODEL_REGISTRY)      # every served arch
    classes = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
               "MixtralForCausalLM": "MixtralConfig", "Phi3ForCausalLM": "Phi3Config",
               "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
               "Qwen2MoeForCausalLM": "Qwen2MoeConfig", "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
               "Gemma2ForCausalLM": "Gemma2Config", "Gemma3ForCausalLM": "Gemma3TextConfig",
               "Olmo2ForCausalLM": "Olmo2Config", "GraniteForCausalLM": "GraniteConfig",
               "SmolLM3ForCausalLM": "SmolLM3Config", "GemmaForCausalLM": "GemmaConfig",
               "Starcoder2ForCausalLM": "Starcoder2Config",
               "GptOssForCausalLM": "GptOssConfig",
               "DeepseekV2ForCausalLM": "DeepseekV2Config",
               "DeepseekV3ForCausalLM": "DeepseekV3Config",
               "GlmForCausalLM": "GlmConfig", "Glm4ForCausalLM": "Glm4Config",
               "CohereForCausalLM": "CohereConfig", "Cohere2ForCausalLM": "Cohere2Config",
               "BertModel": "BertConfig", "BertForMaskedLM": "BertConfig",
               "RobertaModel": "RobertaConfig", "RobertaForMaskedLM": "RobertaConfig",
               "XLMRobertaModel": "XLMRobertaConfig",
               "XLMRobertaForMaskedLM": "XLMRobertaConfig"}
    for arch, name in classes.items():
        default = getattr(transformers, name)().max_position_embeddings
        assert ARCH_DEFAULT_MAX_POSITIONS[arch] == default, arch


@pytest.mark.parametrize("arch,length", [("LlamaForCausalLM", 2048), ("Qwen3ForCausalLM", 32768),
                                         ("Gemma2ForCausalLM", 8192),
                                         ("Gemma3ForCausalLM", 131072)])
def test_absent_key_is_the_architectures_default(tmp_path, arch, length):
    assert ModelInfo.from_dir(_model_dir(tmp_path, arch)).max_model_len == length


def test_the_smallest_length_key_wins_as_in_vllm():
    # a present max_position_embeddings and a smaller seq_length (ChatGLM2's key)
    assert derived_max_len({"max_position_embeddings": 4096, "seq_length": 1024}) == \
        (1024, "seq_length")
    # absent, the class default takes part: LlamaConfig's 2048 under n_positions 4096
    assert derived_max_len({"architectures": ["LlamaForCausalLM"], "n_positions": 4096}) == \
        (2048, "max_position_embeddings")
    # an architecture outside the table: the keys alone, else vLLM's fallback
    assert derived_max_len({"architectures": ["GPT2LMHeadModel"], "n_positions": 1024,
                            "max_seq_len": None}) == (1024, "n_positions")
    assert derived_max_len({"architectures": ["Other"]}) == (FALLBACK_MAX_LEN, "default")


def test_another_key_that_is_not_an_integer_is_refused_by_name(tmp_path):
    with pytest.raises(ModelDirError, match=r"seq_length='long' is invalid: must be an integer"):
        ModelInfo.from_dir(_model_dir(tmp_path, seq_length="long"))


def test_linear_rope_scaling_applies_to_the_derived_length(tmp_path):
    path = _model_dir(tmp_path, "Qwen3ForCausalLM",
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelInfo.from_dir(path).max_model_len == 65536


def test_the_rope_table_is_as_long_as_the_derived_length():
    pytest.importorskip("torch")
    from worker_service.layers.rotary import get_rope
    rope = get_rope(16, {"architectures": ["Gemma2ForCausalLM"], "rope_theta": 10000.0})
    assert rope.cos_cache.shape[0] == 8192
