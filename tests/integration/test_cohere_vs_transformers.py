"""Cohere (CohereForCausalLM: Command-R) and Cohere 2 (Cohere2ForCausalLM: Command-R7B,
Command-A) against transformers on the same tiny random weights, float32 on the CPU
(worker_service/models/tiny_model.py): one LayerNorm feeding attention and the MLP in parallel,
interleaved-pair rope (q/k rows reordered at load: models/pair_rope.py), per-head q/k LayerNorms
(Cohere), logit_scale 0.7, a tied head; Cohere2's sliding layers (window 8) with rope and its
full layer without.

  - logits through the paged cache equal transformers' forward: one whole prefill (with and
    without q/k norms, with biases), and chunked prefills then decodes of two requests batched
    (Cohere2 decoded far past its window),
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, with prefix-cache hits,
  - two gloo ranks give the single rank's logits (q/k norm weights sliced per rank, kv heads
    replicated),
  - logit_scale and the full layers' missing rope matter; bad values are refused naming them.
"""
from __future__ import annotations

import pytest
import torch

from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.config_edit import with_config
from tests.support.engine_checks import check_chunked_greedy, check_greedy_and_prefix_hits
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import assert_tp2_matches_tp1, load, prefill_logits
from tests.support.window_schedule import assert_chunks_and_decodes_match
from worker_service.layers.rotary import NoRope, RotaryEmbedding

IDS = torch.arange(41) * 37 % 500 + 3
VARIANTS = {"cohere-qk-norm": ("cohere", {}),
            "cohere-no-qk-norm-biases": ("cohere", {"use_qk_norm": False,
                                                    "attention_bias": True}),
            "cohere2": ("cohere2", {})}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(tiny_models, variant):
    arch, overrides = VARIANTS[variant]
    path = tiny_models(arch, **overrides)
    ours = load(path)
    attn = ours.model.layers[0].self_attn
    assert attn.use_qk_norm == (variant == "cohere-qk-norm")
    assert (attn.o_proj.bias is not None) == ("biases" in variant)
    torch.testing.assert_close(prefill_logits(ours, IDS), hf_logits(hf_model(path), IDS),
                               rtol=0, atol=1e-4)


def test_cohere2_full_layers_have_no_rope_and_the_others_a_window(tiny_models):
    """Cohere2Config without layer_types: every 4th layer full, the rest sliding."""
    ours = load(tiny_models("cohere2"))
    ropes = [type(layer.self_attn.rotary_emb) for layer in ours.model.layers]
    assert ropes == [RotaryEmbedding] * 3 + [NoRope]
    assert ours.args.layer_windows == (8, 8, 8, 0)
    assert ours.args.shared_window() == 0         # a full layer sees every key


@pytest.mark.parametrize("arch", ["cohere", "cohere2"])
def test_chunked_prefill_and_decode_logits_match_transformers(tiny_models, arch):
    """Two requests prefilled in chunks of 11, 16 and 5 tokens, then decoded side by side."""
    path = tiny_models(arch)
    assert_chunks_and_decodes_match(load(path), hf_model(path), atol=1e-4)


@pytest.mark.parametrize("arch", ["cohere", "cohere2"])
@pytest.mark.parametrize("check", [check_greedy_and_prefix_hits, check_chunked_greedy],
                         ids=["whole-then-prefix-hits", "chunked"])
def test_engine_greedy_matches_transformers(tiny_models, arch, check):
    check(tiny_models(arch), arch)


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    from worker_service.models.tiny_model import make_tiny_model
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / "cohere", arch="cohere", seed=2),
                            make_tiny_model(tmp_path / "cohere-1kv", arch="cohere", seed=3,
                                            num_key_value_heads=1),
                            make_tiny_model(tmp_path / "cohere2", arch="cohere2", seed=4)],
                           tmp_path)


@pytest.mark.slow
def test_tp3_matches_tp1_over_gloo(tmp_path):
    """Three ranks (6 heads): Cohere's q/k norm rows sliced by a start that is not a power of
    two, its kv heads split (3) and replicated (1); GLM's half-rotary reordered rows and GLM-4's
    extra norms; Cohere2's rope-less full layer."""
    from worker_service.models.tiny_model import make_tiny_model
    sizes = {"hidden_size": 96, "num_attention_heads": 6, "head_dim": 16,
             "intermediate_size": 96}
    models = [("cohere", 3), ("cohere", 1), ("cohere2", 3), ("glm4", 1), ("glm", 3)]
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / f"{arch}-{kv}", arch=arch, seed=i,
                                            num_key_value_heads=kv, **sizes)
                            for i, (arch, kv) in enumerate(models)], tmp_path, world_size=3)


def test_logit_scale_and_the_missing_rope_matter(tiny_models, tmp_path):
    """Guards against the tests passing whatever those two do: a scale of 1 and a Cohere2 whose
    every layer rotates change the logits."""
    path = tiny_models("cohere2")
    base = prefill_logits(load(path), IDS)
    unscaled = prefill_logits(load(with_config(path, tmp_path / "s1", logit_scale=1.0)), IDS)
    torch.testing.assert_close(unscaled * 0.7, base, rtol=1e-5, atol=1e-5)
    all_rope = load(with_config(path, tmp_path / "rope", layer_types=["sliding_attention"] * 4))
    assert (prefill_logits(all_rope, IDS) - base).abs().max() > 1e-2


def test_cohere2_with_only_full_layers_needs_no_window(tiny_models, tmp_path):
    """layer_types all full with sliding_window null: transformers' Cohere2Config takes it and
    no Cohere2Attention reads the window, so it is served (no layer rotates, no window).
    transformers' forward still builds a sliding mask it never uses and fails on the null, so
    the reference is the same weights with a window set, which no layer reads either (its
    logits equal those with another window): logits and greedy tokens with prefix hits."""
    full = {"layer_types": ["full_attention"] * 4}
    path = with_config(tiny_models("cohere2"), tmp_path / "full", sliding_window=None, **full)
    refs = [with_config(tiny_models("cohere2"), tmp_path / f"ref{w}", sliding_window=w, **full)
            for w in (8, 4096)]
    ours = load(path)
    assert not any(ours.args.layer_windows) and ours.args.shared_window() == 0
    assert all(isinstance(layer.self_attn.rotary_emb, NoRope) for layer in ours.model.layers)
    want = hf_logits(hf_model(refs[0]), IDS)
    torch.testing.assert_close(hf_logits(hf_model(refs[1]), IDS), want, rtol=0, atol=0)
    torch.testing.assert_close(prefill_logits(ours, IDS), want, rtol=0, atol=1e-4)
    check_greedy_and_prefix_hits(path, "cohere2-all-full", reference_dir=refs[0])


@pytest.mark.parametrize("arch,changes,message", [
    ("cohere", {"logit_scale": None}, r"logit_scale=None is invalid: must be a finite number"),
    ("cohere", {"hidden_act": "gelu"},
     r"hidden_act='gelu' is not supported for CohereForCausalLM: must be 'silu'"),
    ("cohere2", {"sliding_window": None},
     r"sliding_window=None is not supported for Cohere2ForCausalLM with sliding_attention "
     r"layers: must be a positive integer"),
    ("cohere2", {"layer_types": ["sliding_attention"] * 3},
     r"layer_types=.* is invalid: must be num_hidden_layers=4 entries"),
], ids=["logit-scale-null", "gelu", "cohere2-no-window", "layer-types-length"])
def test_bad_config_values_are_refused_naming_them(tiny_models, tmp_path, arch, changes,
                                                   message):
    with pytest.raises(ValueError, match=message):
        load(with_config(tiny_models(arch), tmp_path / "bad", **changes))


# The released checkpoints' config.json keys (transformers 4.x layout), tiny sizes: Command-R
# (no head_dim, use_qk_norm false, its 8e6 theta) and Command-R7B (sliding_window_pattern
# instead of layer_types, rope_scaling null, keys transformers ignores)
HUB = {
    "cohere": {"architectures": ["CohereForCausalLM"], "attention_bias": False,
               "bos_token_id": 5, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 64,
               "initializer_range": 0.02, "intermediate_size": 128, "layer_norm_eps": 1e-05,
               "logit_scale": 0.0625, "max_position_embeddings": 2048, "model_type": "cohere",
               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
               "pad_token_id": 0, "rope_theta": 8000000.0, "torch_dtype": "float32",
               "use_cache": True, "use_qk_norm": False, "vocab_size": 512},
    "cohere2": {"architectures": ["Cohere2ForCausalLM"], "attention_bias": False,
                "attention_dropout": 0.0, "bos_token_id": 5, "cache_implementation": "hybrid",
                "eos_token_id": 0, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
                "initializer_range": 0.02, "intermediate_size": 128, "layer_norm_eps": 1e-05,
                "logit_scale": 0.25, "max_position_embeddings": 2048, "model_type": "cohere2",
                "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
                "order_of_interleaved_layers": "local_attn_first", "pad_token_id": 0,
                "position_embedding_type": "rope_gptj", "rope_scaling": None,
                "rope_theta": 50000, "rotary_pct": 1.0, "sliding_window": 8,
                "sliding_window_pattern": 4, "torch_dtype": "float32", "use_cache": True,
                "use_embedding_sharing": True, "use_parallel_block": True, "vocab_size": 512},
}


@pytest.mark.parametrize("arch", list(HUB))
def test_a_hub_style_config_matches_transformers(tiny_models, tmp_path, arch):
    """The released checkpoints' config.json layout, read as transformers 5 reads it: logits
    and the engine's greedy tokens with chunked prefill."""
    import json
    import shutil
    dst = tmp_path / f"hub-{arch}"
    shutil.copytree(tiny_models(arch, use_qk_norm=False), dst)
    json.dump(HUB[arch], open(dst / "config.json", "w"))
    ours = load(dst)
    torch.testing.assert_close(prefill_logits(ours, IDS), hf_logits(hf_model(str(dst)), IDS),
                               rtol=0, atol=1e-4)
    check_chunked_greedy(str(dst), f"{arch}-hub-config")
