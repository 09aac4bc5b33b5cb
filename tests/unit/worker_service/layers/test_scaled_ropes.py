"""The YaRN and dynamic-NTK rope tables (worker_service/layers/yarn_rope.py, dynamic_rope.py)
against transformers 5's own rotary embedding on the same config, row by row:

  - YaRN: every position's cos and sin equal transformers' (its frequencies and its attention
    factor), over the defaults, beta_fast / beta_slow, mscale / mscale_all_dim, an explicit
    attention_factor, truncate false, a null factor, partial rotary and both config layouts;
    a top-level original_max_position_embeddings wins over the rope dict's, as in transformers;
  - dynamic: positions below max_position_embeddings equal transformers' forward over them, and
    each position past it equals transformers' forward decoding that position next (base of
    p + 1), the table covering factor * max_position_embeddings positions (vLLM's length);
  - bad fields are refused naming them.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from engine_common.model_files.model_dir import model_position_limit
from worker_service.layers.rotary import RopeSettings, get_rope

BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rope_theta": 10000.0}


def _yarn(**fields) -> dict:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            **fields}


YARN_CASES = {
    "defaults": {"rope_scaling": _yarn()},
    "betas": {"rope_scaling": _yarn(beta_fast=8, beta_slow=2)},
    "mscale": {"rope_scaling": _yarn(mscale=0.8, mscale_all_dim=0.5)},
    "attention_factor": {"rope_scaling": _yarn(attention_factor=1.5)},
    "no-truncate": {"rope_scaling": _yarn(truncate=False)},
    "no-factor": {"rope_scaling": _yarn(factor=None), "max_position_embeddings": 96},
    "legacy-type": {"rope_scaling": {"type": "yarn", "factor": 2.0,
                                     "original_max_position_embeddings": 48}},
    "theta-in-params": {"rope_parameters": {**_yarn(), "rope_theta": 5e5}},
    "partial": {"rope_scaling": _yarn(), "partial_rotary_factor": 0.5},
    "top-level-original": {"rope_scaling": _yarn(), "original_max_position_embeddings": 16},
}


def _hf_cos_sin(config_class, config: dict, positions: torch.Tensor):
    """transformers' rotary embedding of `config` at `positions` ([1, T]): (cos, sin) [T, D]."""
    hf_config = config_class(**config)
    module = {tf.Qwen3Config: tf.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding,
              tf.LlamaConfig: tf.models.llama.modeling_llama.LlamaRotaryEmbedding}[config_class]
    cos, sin = module(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0], sin[0]


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_tables_equal_transformers(case):
    config = {**BASE, "max_position_embeddings": 128, **YARN_CASES[case]}
    rope = get_rope(16, {**config, "architectures": ["Qwen3ForCausalLM"]})
    n = rope.cos_cache.shape[0]
    cos, sin = _hf_cos_sin(tf.Qwen3Config, config, torch.arange(n)[None])
    torch.testing.assert_close(rope.cos_cache, cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache, sin, rtol=0, atol=1e-6)
    assert (cos[1] ** 2 + sin[1] ** 2).mean() != pytest.approx(1.0), "the attention factor applies"


def test_yarn_length_is_the_original_times_the_factor():
    """vLLM's rule: a Qwen2.5 config with YaRN x4 over 32768 serves 131072 positions."""
    qwen = {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32768}}
    assert model_position_limit(qwen) == 131072
    assert model_position_limit({**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}) \
        == 65536        # no original: max_position_embeddings (transformers' standardization)
    assert get_rope(16, {**BASE, **YARN_CASES["defaults"]}).cos_cache.shape == (128, 16)


def test_yarn_without_a_factor_key_is_refused_as_transformers_refuses_it():
    """transformers' YaRN validation requires the `factor` key (KeyError at config load) and
    vLLM's get_rope reads it; only an explicit null falls back to max_position_embeddings /
    original_max_position_embeddings (_compute_yarn_parameters, the "no-factor" case above).
    The scheduler's length and the worker's tables refuse it alike, naming the key."""
    scaling = {"rope_type": "yarn", "original_max_position_embeddings": 32}
    config = {**BASE, "max_position_embeddings": 128, "rope_scaling": scaling}
    with pytest.raises(KeyError):
        tf.Qwen3Config(**config)
    message = r"yarn rope scaling has no 'factor' key: must be set \(a number >= 1, or null"
    with pytest.raises(ValueError, match=message):
        get_rope(16, config)
    with pytest.raises(ValueError, match=message):
        model_position_limit({**config, "architectures": ["Qwen3ForCausalLM"]})
    null = {**config, "rope_scaling": {**scaling, "factor": None}}
    assert model_position_limit({**null, "architectures": ["Qwen3ForCausalLM"]}) == 128
    assert get_rope(16, null).cos_cache.shape == (128, 16)


def test_dynamic_tables_equal_transformers_within_and_decoding_past_the_length():
    config = {**BASE, "max_position_embeddings": 40,
              "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}
    rope = get_rope(16, {**config, "architectures": ["LlamaForCausalLM"]})
    assert rope.cos_cache.shape == (120, 16)
    hf_rope = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(tf.LlamaConfig(**config))
    x = torch.zeros(1)
    cos, sin = hf_rope(x, torch.arange(40)[None])          # a prefill within the length
    torch.testing.assert_close(rope.cos_cache[:40], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache[:40], sin[0], rtol=0, atol=1e-6)
    default = get_rope(16, {**BASE, "max_position_embeddings": 120})
    for p in range(40, 120):                               # then one token at a time
        cos, sin = hf_rope(x, torch.tensor([[p]]))
        # angles up to ~120 rad, where a float32 ulp is 7.6e-6: a last-bit difference of a
        # frequency (a batched pow against transformers' one-row pow) moves cos/sin by ~2e-6
        torch.testing.assert_close(rope.cos_cache[p], cos[0, 0], rtol=0, atol=1e-5)
        torch.testing.assert_close(rope.sin_cache[p], sin[0, 0], rtol=0, atol=1e-5)
    assert not torch.allclose(rope.cos_cache[100], default.cos_cache[100], atol=1e-3), \
        "past the length the base grows"


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "dynamic"}, r"dynamic rope scaling factor=None is invalid: must be a number"),
    ({"rope_type": "dynamic", "factor": 0.5}, r"factor=0.5 is invalid: must be a number >= 1"),
    (_yarn(factor="4"), r"yarn rope scaling factor='4' is invalid: must be a number >= 1"),
    (_yarn(beta_fast="x"), r"yarn rope scaling beta_fast='x' is invalid: must be a finite"),
    (_yarn(mscale=float("nan")), r"yarn rope scaling mscale=nan is invalid"),
    (_yarn(original_max_position_embeddings=0),
     r"yarn original_max_position_embeddings=0 is invalid: must be a positive integer"),
])
def test_bad_scaling_fields_are_refused_by_name(scaling, message):
    with pytest.raises(ValueError, match=message):
        get_rope(16, {**BASE, "max_position_embeddings": 64, "rope_scaling": scaling})


def test_rope_settings_keep_the_lengths_the_tables_need():
    settings = RopeSettings.from_hf_config({"architectures": ["Qwen3ForCausalLM"],
                                            "rope_scaling": _yarn()})
    assert settings.scaling["max_position_embeddings"] == 32768     # Qwen3Config's default
    assert settings.scaling["original_max_position_embeddings"] == 32


def test_a_whole_float_original_length_is_read_as_transformers_does():
    config = {**BASE, "max_position_embeddings": 128, "rope_scaling": _yarn(),
              "original_max_position_embeddings": 32.0}
    assert model_position_limit(config) == 128
    assert get_rope(16, config).cos_cache.shape == (128, 16)
