"""Which original_max_position_embeddings a LongRoPE (and llama3) table is built from, against
transformers 5 loading the same config.json (Phi-3-mini-128k / Phi-3.5-mini / Phi-4-mini
shapes, small): standardize_rope_params lets the config attribute win over the rope dict, and
Phi3Config always has that attribute (4096 by default), so

  - a top-level key wins over the dict's value;
  - without a top-level key a Phi-3 config switches to the long factors at 4096, whatever the
    dict says (not at max_position_embeddings, not at the dict's value);
  - "su", the first Phi-3-mini-128k config's name for it, is longrope (Phi3Config and vLLM);
  - a llama3 dict without the key reads max_position_embeddings (it was a KeyError).

Each table row p is compared with transformers' rotary embedding decoding position p (its
long factors switch on once the sequence passes the original length).
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from worker_service.layers.rotary import get_rope

HALF = 8        # head_dim 16: 8 short and 8 long factors
PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "num_hidden_layers": 2, "vocab_size": 300, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "original_max_position_embeddings": 2048,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 50 for i in range(HALF)],
                         "long_factor": [1.0 + i for i in range(HALF)]}}
POSITIONS = (0, 7, 2047, 2048, 4095, 4096, 8191)


def _without_top_level(**dict_fields) -> dict:
    cfg = {k: v for k, v in PHI3.items() if k != "original_max_position_embeddings"}
    return {**cfg, "rope_scaling": {**PHI3["rope_scaling"], **dict_fields}}


CASES = {
    "top-level": (PHI3, 2048),
    "top-level-over-dict": ({**PHI3, "rope_scaling": {**PHI3["rope_scaling"],
                                                      "original_max_position_embeddings": 1024}},
                            2048),
    "class-default-over-dict": (_without_top_level(original_max_position_embeddings=1024), 4096),
    "class-default": (_without_top_level(), 4096),
}


def _hf_rows(config: dict, tmp_path) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (cos, sin) of each of POSITIONS, decoding it next (one row each)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    rope = tf.models.phi3.modeling_phi3.Phi3RotaryEmbedding(tf.AutoConfig.from_pretrained(tmp_path))
    rows = [rope(torch.zeros(1), torch.tensor([[p]])) for p in POSITIONS]
    return torch.cat([c[0] for c, _ in rows]), torch.cat([s[0] for _, s in rows])


@pytest.mark.parametrize("case", list(CASES))
def test_longrope_original_length_is_transformers(case, tmp_path):
    config, switch = CASES[case]
    rope = get_rope(16, config)
    cos, sin = _hf_rows(config, tmp_path)
    rows = list(POSITIONS)
    torch.testing.assert_close(rope.cos_cache[rows], cos, rtol=0, atol=2e-6)
    torch.testing.assert_close(rope.sin_cache[rows], sin, rtol=0, atol=2e-6)
    short_then_long = get_rope(16, {**PHI3, "original_max_position_embeddings": switch})
    torch.testing.assert_close(rope.cos_cache, short_then_long.cos_cache, rtol=0, atol=0)


def test_su_is_longrope():
    su = get_rope(16, {**PHI3, "rope_scaling": {**PHI3["rope_scaling"], "type": "su"}})
    torch.testing.assert_close(su.cos_cache, get_rope(16, PHI3).cos_cache, rtol=0, atol=0)
    assert su.cos_cache.shape == (8192, 16)      # already the long length: not stretched


def test_llama3_without_an_original_length_reads_max_position_embeddings():
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 300,
              "max_position_embeddings": 512,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0}}
    rope = get_rope(16, config)
    hf = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(tf.LlamaConfig(**config))
    cos, sin = hf(torch.zeros(1), torch.arange(512)[None])
    torch.testing.assert_close(rope.cos_cache, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache, sin[0], rtol=0, atol=1e-6)


def test_a_bad_original_length_is_refused_naming_the_rope_type():
    with pytest.raises(ValueError, match=r"longrope original_max_position_embeddings='x' is "
                                         r"invalid: must be a positive integer"):
        get_rope(16, {**PHI3, "original_max_position_embeddings": "x"})


def test_a_fractional_llama3_original_length_is_read_as_transformers_does():
    """A GGUF's rope_freqs.weight can solve to a fractional context (gguf_config.py); llama3's
    formula only divides by it, and transformers takes it as is."""
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 300,
              "max_position_embeddings": 512,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 300.5}}
    rope = get_rope(16, config)
    hf = tf.models.llama.modeling_llama.LlamaRotaryEmbedding(tf.LlamaConfig(**config))
    cos, _ = hf(torch.zeros(1), torch.arange(512)[None])
    torch.testing.assert_close(rope.cos_cache, cos[0], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"llama3 original_max_position_embeddings=-1 is "
                                         r"invalid: must be a positive number"):
        get_rope(16, {**config, "original_max_position_embeddings": -1})
