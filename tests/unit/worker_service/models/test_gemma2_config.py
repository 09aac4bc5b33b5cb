"""Gemma 2's config.json as transformers' Gemma2Config reads it (models/gemma2.py): layer types,
the window, the scale and both softcaps, with each key absent (the class defaults), null and set.
"""
from __future__ import annotations

import pytest

from worker_service.models.gemma2 import Gemma2Options

transformers = pytest.importorskip("transformers")

# gemma-2-2b's shape (config.json as on the Hub), six layers to keep it short
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
          "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
          "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
          "query_pre_attn_scalar": 256, "sliding_window": 4096,
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
          "rope_theta": 10000.0, "max_position_embeddings": 8192}
ABSENT = ("layer_types", "sliding_window", "attn_logit_softcapping",
          "final_logit_softcapping", "query_pre_attn_scalar")


def theirs(cfg: dict):
    return transformers.Gemma2Config(**{k: v for k, v in cfg.items() if k != "architectures"})


def test_absent_keys_take_gemma2configs_defaults():
    cfg = {k: v for k, v in GEMMA2.items() if k not in ABSENT}
    ours, hf = Gemma2Options.from_hf(cfg), theirs(cfg)
    assert list(ours.layer_types) == hf.layer_types
    assert ours.layer_types[:2] == ("sliding_attention", "full_attention")   # sliding first
    assert ours.sliding_window == hf.sliding_window == 4096
    assert ours.attn_logit_softcapping == hf.attn_logit_softcapping == 50.0
    assert ours.final_logit_softcapping == hf.final_logit_softcapping == 30.0
    assert ours.query_pre_attn_scalar == hf.query_pre_attn_scalar == 256
    assert ours.layer_windows == (4096, 0) * 3


def test_null_caps_are_none_and_layer_types_are_taken_as_given():
    types = ["full_attention"] * 2 + ["sliding_attention"] * 4
    ours = Gemma2Options.from_hf({**GEMMA2, "attn_logit_softcapping": None,
                                  "final_logit_softcapping": None, "layer_types": types,
                                  "sliding_window": 16})
    assert ours.attn_logit_softcapping is None and ours.final_logit_softcapping is None
    assert ours.layer_windows == (0, 0, 16, 16, 16, 16)
    assert ours.rope["sliding_attention"] == ours.rope["full_attention"]   # one table


@pytest.mark.parametrize("change,words", [
    ({"attn_logit_softcapping": -5.0}, "softcapping=-5.0 is invalid"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window=None"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
])
def test_refused_at_load(change, words):
    with pytest.raises(ValueError, match="config.json") as e:
        Gemma2Options.from_hf({**GEMMA2, **change})
    assert words in str(e.value)
