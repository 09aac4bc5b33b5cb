"""Which rope dict config.json's rope is read from (rope_config.rope_layout): rope_parameters
(transformers 5) or rope_scaling (older), never a merge of the two.

A YaRN block pasted as rope_scaling into a config transformers 5 saved (rope_parameters with
rope_type default) was merged under rope_parameters, so YaRN was silently dropped: default rope
and 40960 positions where transformers rotates with YaRN over 131072. transformers itself reads
rope_scaling alone and drops rope_parameters' rope_theta (checked here), which is not what such
a user meant either: both set is refused naming both, on the scheduler's side (max_model_len)
and the worker's (the rotary tables).
"""
from __future__ import annotations

import json

import pytest
import transformers as tf

from engine_common.model_files.model_dir import ModelDirError, model_position_limit
from engine_common.model_files.rope_config import rope_scaling_fields
from worker_service.layers.rotary import get_rope

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
            "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 300,
            "max_position_embeddings": 40960,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000}}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_a_pasted_rope_scaling_next_to_rope_parameters_is_refused_naming_both(tmp_path):
    config = {**QWEN3_8B, "rope_scaling": YARN}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = tf.AutoConfig.from_pretrained(tmp_path)       # why neither reading is served:
    assert hf.rope_parameters["rope_type"] == "yarn"    # transformers takes rope_scaling
    assert hf.rope_parameters["rope_theta"] != 1000000  # and drops rope_parameters' theta
    message = r"rope_scaling=.*'yarn'.* and rope_parameters=.*'default'.* are both set"
    with pytest.raises(ModelDirError, match=message):
        model_position_limit(config)
    with pytest.raises(ValueError, match=message):
        get_rope(16, config)


@pytest.mark.parametrize("empty", [None, {}])
def test_an_empty_rope_scaling_leaves_rope_parameters(empty):
    config = {**QWEN3_8B, "rope_parameters": {**YARN, "rope_theta": 1000000},
              "rope_scaling": empty}
    assert model_position_limit(config) == 131072
    assert rope_scaling_fields(config)["rope_type"] == "yarn"
    assert get_rope(16, config).cos_cache.shape == (131072, 16)


def test_rope_scaling_alone_is_read_with_the_top_level_theta():
    config = {**{k: v for k, v in QWEN3_8B.items() if k != "rope_parameters"},
              "rope_theta": 1000000.0, "rope_scaling": {**YARN, "type": "yarn"}}
    assert model_position_limit(config) == 131072


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_a_rope_dict_that_is_not_an_object_is_refused(key):
    config = {k: v for k, v in QWEN3_8B.items() if k != "rope_parameters"}
    with pytest.raises(ModelDirError, match=rf"{key}='yarn' is invalid: must be an object"):
        model_position_limit({**config, key: "yarn"})
