"""Gemma 3 config.json reading (models/gemma3_config.py) against transformers' Gemma3TextConfig
on the same dicts: layer types, windows and the two rope tables, in the Hub layout (rope_theta,
rope_local_base_freq, rope_scaling, sliding_window_pattern) and transformers 5's
(rope_parameters by layer type, layer_types); and the configs refused at load."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from worker_service.layers.rotary import RopeSettings, RotaryEmbedding, compute_inv_freq
from worker_service.models.gemma3_config import FULL, SLIDING, Gemma3Options
from worker_service.models.tp_sizes import valid_tp_sizes

# google/gemma-3-1b-it's config.json (the fields that matter here)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
    "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
    "max_position_embeddings": 32768, "vocab_size": 262144, "rms_norm_eps": 1e-06,
    "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh",
}
# gemma-3-4b-it's text_config: linear rope scaling x8 on the full layers
GEMMA3_4B = {**GEMMA3_1B, "hidden_size": 2560, "intermediate_size": 10240,
             "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
             "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
             "max_position_embeddings": 131072}


def _theirs(cfg: dict) -> tf.Gemma3TextConfig:
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    return tf.Gemma3TextConfig(**fields)


def _inv_freq(settings: RopeSettings, head_dim: int):
    return compute_inv_freq(head_dim, settings)


@pytest.mark.parametrize("cfg", [GEMMA3_1B, GEMMA3_4B], ids=["1b", "4b-text"])
def test_hub_layout_reads_as_transformers(cfg):
    ours, theirs = Gemma3Options.from_hf(cfg), _theirs(cfg)
    assert list(ours.layer_types) == theirs.layer_types
    assert ours.layer_types[5] == FULL and ours.layer_types[4] == SLIDING
    assert ours.layer_windows == tuple(cfg["sliding_window"] if t == SLIDING else 0
                                       for t in theirs.layer_types)
    for layer_type, params in theirs.rope_parameters.items():
        settings = ours.rope[layer_type]
        assert settings.rope_type == params["rope_type"]
        assert settings.theta == params["rope_theta"]
        assert settings.scaling.get("factor") == params.get("factor")
    assert ours.rope[SLIDING].theta == 10000 and ours.rope[FULL].theta == 1e6
    assert ours.query_pre_attn_scalar == 256 and ours.final_logit_softcapping is None


def test_transformers5_layout_round_trips():
    """What transformers 5 writes (rope_parameters by type, layer_types) reads back the same."""
    saved = _theirs(GEMMA3_4B).to_dict()
    ours = Gemma3Options.from_hf(saved)
    assert ours == Gemma3Options.from_hf(GEMMA3_4B)
    assert ours.rope[FULL].rope_type == "linear" and ours.rope[FULL].scaling["factor"] == 8.0
    # the full table is the default one slowed 8x; the sliding one is the default at 1e4
    full, default = _inv_freq(ours.rope[FULL], 256), _inv_freq(RopeSettings(theta=1e6), 256)
    assert (full * 8 - default).abs().max() < 1e-12


def test_defaults_match_transformers():
    """No rope fields, no sliding_window, no layer_types: transformers' defaults."""
    cfg = {k: v for k, v in GEMMA3_1B.items()
           if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window",
                        "sliding_window_pattern")}
    ours, theirs = Gemma3Options.from_hf(cfg), _theirs(cfg)
    assert ours.sliding_window == theirs.sliding_window == 4096
    assert list(ours.layer_types) == theirs.layer_types
    assert {t: s.theta for t, s in ours.rope.items()} == {
        t: p["rope_theta"] for t, p in theirs.rope_parameters.items()}


@pytest.mark.parametrize("change,words", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"final_logit_softcapping": -1.0}, "softcapping=-1.0 is invalid"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
    ({"sliding_window": None}, "sliding_window=None"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
    ({"layer_types": ["chunked_attention"] * 26}, "layer_types ['chunked_attention']"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "nested by layer type"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "rope_type='proportional'"),
])
def test_refused_at_load(change, words):
    with pytest.raises(ValueError) as e:
        Gemma3Options.from_hf({**GEMMA3_1B, **change})
    assert words in str(e.value)


def test_final_logit_softcap_is_read():
    assert Gemma3Options.from_hf({**GEMMA3_1B,
                                  "final_logit_softcapping": 30.0}).final_logit_softcapping == 30


def test_one_kv_head_splits_over_any_head_split():
    """gemma-3-1b: 4 query heads, 1 kv head (replicated on every rank, as for Llama)."""
    assert valid_tp_sizes(GEMMA3_1B) == [1, 2, 4]


def test_a_gemma3_gguf_is_read_as_gemma3(tmp_path):
    """GGUF Gemma 3 text files are read (engine_common/model_files/gguf_families.py; their
    tests: tests/unit/engine_common/model_files/test_gguf_families.py)."""
    from engine_common.model_files.gguf_config import hf_config_from_gguf
    from tests.unit.engine_common.model_files.test_gguf_config import _minimal
    cfg = hf_config_from_gguf(_minimal(tmp_path, arch="gemma3"))
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"


# a YaRN full-attention rope with its own original length next to a top-level one
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
_TINY = {**GEMMA3_1B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "num_hidden_layers": 2, "sliding_window": 8,
         "layer_types": [SLIDING, FULL], "max_position_embeddings": 512,
         "original_max_position_embeddings": 64, "rope_theta": 100.0}


@pytest.mark.parametrize("fields", [
    {"rope_scaling": None, "rope_theta": None,
     "rope_parameters": {FULL: {**_YARN, "rope_theta": 100.0},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}}},
    {"rope_scaling": _YARN},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
], ids=["nested", "hub", "hub-no-original"])
def test_a_yarn_original_length_is_the_layer_types_own(fields, tmp_path):
    """transformers standardizes nested rope dicts with setdefault: each type's own original
    length (else max_position_embeddings) wins over a top-level original_max_position_embeddings
    (which had been passed along and won: 64 where transformers reads 128, or 512)."""
    config = {k: v for k, v in {**_TINY, **fields}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = tf.AutoConfig.from_pretrained(tmp_path)
    rope = tf.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(hf_config)
    cos, sin = rope(torch.zeros(1), torch.arange(512)[None], layer_type=FULL)
    ours = RotaryEmbedding(16, 512, Gemma3Options.from_hf(config).rope[FULL])
    torch.testing.assert_close(ours.cos_cache, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.sin_cache, sin[0], rtol=0, atol=1e-6)
