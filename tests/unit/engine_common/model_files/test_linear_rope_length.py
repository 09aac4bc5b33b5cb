"""A linear rope-scaled model's length is max_position_embeddings times the factor, as vLLM
derives it: such a config (Vicuna-v1.5-16k: 4096, linear factor 4) was capped at 4096 and a
max_model_len of 16384 refused, though transformers' rope takes every position and the model
was tuned to 16384. The rotary table is as long, so every admitted position has a row, and its
rows past max_position_embeddings equal transformers' linear rope there. Llama 3 scaling (whose
max_position_embeddings is already the extended one) and no scaling keep the plain value."""
from __future__ import annotations

import json

import pytest
import torch

from engine_common.model_files.model_dir import ModelDirError, ModelInfo, model_position_limit
from worker_service.layers.rotary import get_rope

LINEAR = {"rope_scaling": {"type": "linear", "factor": 4.0}}
LLAMA3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


def _model_dir(tmp_path, **fields):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32,
              "max_position_embeddings": 256, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_linear_scaling_extends_the_length_others_do_not(tmp_path):
    assert ModelInfo.from_dir(_model_dir(tmp_path, **LINEAR)).max_model_len == 1024
    assert ModelInfo.from_dir(_model_dir(tmp_path, **LINEAR), 1024).max_model_len == 1024
    with pytest.raises(ModelDirError, match=r"max_model_len=1025 .*\[2, 1024\]"):
        ModelInfo.from_dir(_model_dir(tmp_path, **LINEAR), 1025)
    assert ModelInfo.from_dir(_model_dir(tmp_path, **LLAMA3)).max_model_len == 256
    assert ModelInfo.from_dir(_model_dir(tmp_path)).max_model_len == 256
    # transformers 5's layout names it rope_parameters
    params = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
    assert model_position_limit({"max_position_embeddings": 256, **params}) == 512


@pytest.mark.parametrize("factor", [None, "4", 0.5, True])
def test_a_bad_linear_factor_is_refused_by_name(tmp_path, factor):
    with pytest.raises(ModelDirError, match="linear rope scaling factor=.* must be a number"):
        ModelInfo.from_dir(_model_dir(tmp_path, rope_scaling={"type": "linear",
                                                              "factor": factor}))


def test_the_rotary_table_covers_the_length_and_equals_transformers_past_the_base():
    transformers = pytest.importorskip("transformers")
    config = {"max_position_embeddings": 256, "hidden_size": 64, "num_attention_heads": 4,
              "rope_theta": 10000.0, **LINEAR}
    rope = get_rope(16, config)
    q = torch.randn(3, 4, 16)
    k = torch.randn(3, 4, 16)
    positions = torch.tensor([0, 700, 1023])          # past 256: the linear range
    got_q, got_k = rope(positions, q.clone(), k.clone())
    hf_config = transformers.LlamaConfig(**config)
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    cos, sin = hf_rope(q, positions[None])
    want_q, want_k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma3"])
def test_gemma3_keeps_its_length(tmp_path, model_type):
    """Gemma 3's max_position_embeddings is already the scaled length (its 4B+ configs say
    131072 with linear factor 8 on the full layers; vLLM skips the factor for gemma3 too); its
    rope tables (models/gemma3.py) are that long, so a factor applied here would admit
    positions they have no row for."""
    path = _model_dir(tmp_path, model_type=model_type, **LINEAR)
    assert ModelInfo.from_dir(path).max_model_len == 256


@pytest.mark.parametrize("pad, limit", [(None, 512), (1, 512), (0, 513)])
def test_roberta_positions_start_after_its_pad_id(pad, limit):
    """RoBERTa numbers positions from pad_token_id + 1 (a pad id of 0 is 0, not the default)."""
    config = {"model_type": "roberta", "max_position_embeddings": 514}
    if pad is not None:
        config["pad_token_id"] = pad
    assert model_position_limit(config) == limit


@pytest.mark.parametrize("scaling, limit", [
    ({"type": "dynamic", "factor": 2.0}, 512),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    ({"rope_type": "yarn", "factor": 3.0}, 768),        # original absent: max_position_embeddings
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64},
     256),      # factor null: max_position_embeddings (a missing key is refused)
])
def test_dynamic_and_yarn_stretch_the_length_as_vllm(tmp_path, scaling, limit):
    """vLLM: dynamic multiplies the model's length by its factor, YaRN its original length."""
    assert ModelInfo.from_dir(_model_dir(tmp_path, rope_scaling=scaling)).max_model_len == limit
    with pytest.raises(ModelDirError, match=rf"max_model_len={limit + 1} exceeds"):
        ModelInfo.from_dir(_model_dir(tmp_path, rope_scaling=scaling), limit + 1)


@pytest.mark.parametrize("scaling", [{"type": "dynamic"}, {"type": "yarn", "factor": "4"},
                                     {"type": "yarn", "factor": 4.0,
                                      "original_max_position_embeddings": -1}])
def test_a_bad_dynamic_or_yarn_field_is_refused_by_name(tmp_path, scaling):
    with pytest.raises(ModelDirError, match=r"(dynamic|yarn) .*=.* is invalid: must be"):
        ModelInfo.from_dir(_model_dir(tmp_path, rope_scaling=scaling))
