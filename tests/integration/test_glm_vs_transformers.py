"""GLM (GlmForCausalLM) and GLM-4 (Glm4ForCausalLM) against transformers on the same tiny random
weights, float32 on the CPU (worker_service/models/tiny_model.py): rope over half of each head
rotating interleaved pairs (served by reordering the q/k rows at load: models/pair_rope.py),
q/k/v biases, the fused gate_up_proj, GLM-4's two extra norms.

  - logits through the paged cache equal transformers' forward: one whole prefill (GLM and
    GLM-4, without biases, a partial_rotary_factor in the rope dict, a config.json without the
    keys GlmConfig defaults), and chunked prefills then decodes of two requests batched,
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, with prefix-cache hits,
  - two gloo ranks give the single rank's logits (kv heads split, and replicated),
  - another activation is refused naming it (LoRA: test_lora_families.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.config_edit import with_config
from tests.support.engine_checks import check_chunked_greedy, check_greedy_and_prefix_hits
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import assert_tp2_matches_tp1, load, prefill_logits
from tests.support.window_schedule import assert_chunks_and_decodes_match

IDS = torch.arange(41) * 37 % 500 + 3
VARIANTS = {"glm": ("glm", {}), "glm4": ("glm4", {}),
            "glm4-no-bias": ("glm4", {"attention_bias": False}),
            "glm4-rotary-0.75-in-rope-dict": (
                "glm4", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.75}})}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(tiny_models, variant):
    arch, overrides = VARIANTS[variant]
    path = tiny_models(arch, **overrides)
    ours = load(path)
    rope = ours.model.layers[0].self_attn.rotary_emb
    assert rope.rotary_dim == (12 if "0.75" in variant else 8)      # of head_dim 16
    assert (ours.model.layers[0].self_attn.qkv_proj.bias is None) == ("no-bias" in variant)
    assert ours.model.layers[0].self_attn.o_proj.bias is None
    torch.testing.assert_close(prefill_logits(ours, IDS), hf_logits(hf_model(path), IDS),
                               rtol=0, atol=1e-4)


def test_config_without_glm_keys_reads_glmconfig_defaults(tiny_models, tmp_path):
    """head_dim (128), num_key_value_heads (2) and partial_rotary_factor (0.5) absent: the
    config class's defaults, not hidden_size / heads, every head a kv head, or full rotary."""
    src = tiny_models("glm4", head_dim=128, num_key_value_heads=2)
    dst = with_config(src, tmp_path / "bare")
    cfg = json.load(open(f"{dst}/config.json"))
    for key in ("head_dim", "num_key_value_heads", "partial_rotary_factor"):
        cfg.pop(key, None)
    cfg.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    json.dump(cfg, open(f"{dst}/config.json", "w"))
    ours = load(dst)
    attn = ours.model.layers[0].self_attn
    assert (attn.head_dim, attn.num_kv_heads, attn.rotary_emb.rotary_dim) == (128, 2, 64)
    torch.testing.assert_close(prefill_logits(ours, IDS), hf_logits(hf_model(dst), IDS),
                               rtol=0, atol=1e-4)


def test_chunked_prefill_and_decode_logits_match_transformers(tiny_models):
    """Two requests prefilled in chunks of 11, 16 and 5 tokens, then decoded side by side."""
    path = tiny_models("glm4")
    assert_chunks_and_decodes_match(load(path), hf_model(path), atol=1e-4)


@pytest.mark.parametrize("arch", ["glm", "glm4"])
@pytest.mark.parametrize("check", [check_greedy_and_prefix_hits, check_chunked_greedy],
                         ids=["whole-then-prefix-hits", "chunked"])
def test_engine_greedy_matches_transformers(tiny_models, arch, check):
    check(tiny_models(arch), arch)


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    from worker_service.models.tiny_model import make_tiny_model
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / "glm4", arch="glm4", seed=2),
                            make_tiny_model(tmp_path / "glm-1kv", arch="glm", seed=3,
                                            num_key_value_heads=1)], tmp_path)


def test_another_activation_is_refused(tiny_models, tmp_path):
    path = tiny_models("glm4")
    with pytest.raises(ValueError, match=r"hidden_act='gelu' is not supported for "
                                         r"Glm4ForCausalLM: must be 'silu'"):
        load(with_config(path, tmp_path / "gelu", hidden_act="gelu"))


# GLM-4-9B-0414's config.json keys (transformers 4.x layout: rope_theta and
# partial_rotary_factor at the top level, no rope_parameters), tiny sizes, another theta
HUB_GLM4 = {"architectures": ["Glm4ForCausalLM"], "attention_bias": True,
            "attention_dropout": 0.0, "eos_token_id": [0, 1, 2], "head_dim": 16,
            "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 128, "max_position_embeddings": 2048, "model_type": "glm4",
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "pad_token_id": 0, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
            "rope_theta": 500.0, "tie_word_embeddings": False, "torch_dtype": "float32",
            "transformers_version": "4.51.3", "use_cache": True, "vocab_size": 512}


def test_a_hub_style_config_matches_transformers(tiny_models, tmp_path):
    """The released checkpoint's config.json layout, read as transformers 5 reads it: logits and
    the engine's greedy tokens with chunked prefill."""
    import shutil
    dst = tmp_path / "hub-glm4"
    shutil.copytree(tiny_models("glm4"), dst)
    json.dump(HUB_GLM4, open(dst / "config.json", "w"))
    ours = load(dst)
    assert ours.model.layers[0].self_attn.rotary_emb.rotary_dim == 8
    torch.testing.assert_close(prefill_logits(ours, IDS), hf_logits(hf_model(str(dst)), IDS),
                               rtol=0, atol=1e-4)
    check_chunked_greedy(str(dst), "glm4-hub-config")
