"""SmolLM3 and Gemma (1) against transformers on the same tiny random weights, float32 on the
CPU (worker_service/models/tiny_model.py): SmolLM3 with every second layer NoPE (no rope on q
and k) and a tied head; Gemma with its sqrt(hidden)-scaled embedding, (1 + w) RMSNorm and
gelu-tanh GeGLU.

  - logits through the paged cache equal transformers' forward: one whole prefill, and chunked
    prefills then decodes of two requests batched,
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, with prefix-cache hits,
  - two gloo ranks give the single rank's logits,
  - SmolLM3's NoPE layers matter (rope on every layer changes the logits), an explicit
    no_rope_layers list is read, and bad NoPE / window fields are refused naming them,
  - Gemma's legacy hidden_act "gelu" is served as the tanh GeLU (GemmaConfig's rewrite), other
    activations and bidirectional attention are refused, absent head_dim / tie_word_embeddings
    are GemmaConfig's 256 / tied (LoRA: test_lora_families.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.config_edit import with_config
from tests.support.engine_checks import check_chunked_greedy, check_greedy_and_prefix_hits
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import BACKEND, assert_tp2_matches_tp1, load, prefill_logits
from tests.support.window_schedule import assert_chunks_and_decodes_match
from worker_service.layers.rotary import NoRope, RotaryEmbedding
from worker_service.models.gemma import GemmaForCausalLM
from worker_service.models.smollm3 import rope_layers, smollm3_layer_windows
from worker_service.parallel_state import single_rank_group

ARCHS = ("smollm3", "gemma")


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_models, arch):
    path = tiny_models(arch)
    ids = torch.arange(41) * 37 % 500 + 3
    expected = hf_logits(hf_model(path), ids)
    torch.testing.assert_close(prefill_logits(load(path), ids), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_logits_match_transformers(tiny_models, arch):
    """Two requests prefilled in chunks of 11, 16 and 5 tokens, then decoded side by side."""
    path = tiny_models(arch)
    assert_chunks_and_decodes_match(load(path), hf_model(path), atol=1e-4)


@pytest.mark.parametrize("check", [check_greedy_and_prefix_hits, check_chunked_greedy],
                         ids=["whole-then-prefix-hits", "chunked"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_matches_transformers(tiny_models, arch, check):
    check(tiny_models(arch), arch)


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    from worker_service.models.tiny_model import make_tiny_model
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / arch, arch=arch, seed=2)
                            for arch in ARCHS], tmp_path)


def test_smollm3_nope_layers_skip_the_rope_and_matter(tiny_models, tmp_path):
    path = tiny_models("smollm3")
    ours = load(path)
    ropes = [type(layer.self_attn.rotary_emb) for layer in ours.model.layers]
    assert ropes == [RotaryEmbedding, NoRope, RotaryEmbedding, NoRope]
    assert ours.lm_head_is_tied
    ids = torch.arange(23) * 37 % 500 + 3
    all_rope = load(with_config(path, tmp_path / "all", no_rope_layers=[1, 1, 1, 1]))
    assert (prefill_logits(all_rope, ids) - prefill_logits(ours, ids)).abs().max() > 1e-2


def test_smollm3_explicit_no_rope_layers_match_transformers(tiny_models):
    path = tiny_models("smollm3", no_rope_layers=[0, 1, 1, 0])
    ids = torch.arange(29) * 37 % 500 + 3
    torch.testing.assert_close(prefill_logits(load(path), ids), hf_logits(hf_model(path), ids),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("cfg, words", [
    ({"no_rope_layers": [1, 0]}, r"no_rope_layers=\[1, 0\] is invalid: must be "
                                 r"num_hidden_layers=4 entries of 1"),
    ({"no_rope_layers": [1, 2, 1, 1]}, r"no_rope_layers=\[1, 2, 1, 1\] is invalid"),
    ({"no_rope_layer_interval": 0}, r"no_rope_layer_interval=0 is invalid: must be a positive"),
])
def test_smollm3_bad_nope_fields_are_refused(cfg, words):
    with pytest.raises(ValueError, match=words):
        rope_layers({"num_hidden_layers": 4, **cfg})


def test_smollm3_windows_follow_its_config():
    base = {"num_hidden_layers": 4, "no_rope_layer_interval": 2}
    assert smollm3_layer_windows(base, 4) == (0, 0, 0, 0)
    on = {**base, "use_sliding_window": True, "sliding_window": 8}
    assert smollm3_layer_windows(on, 4) == (0, 8, 0, 8)          # the NoPE layers
    types = ["sliding_attention", "full_attention"] * 2
    assert smollm3_layer_windows({**on, "layer_types": types}, 4) == (8, 0, 8, 0)
    with pytest.raises(ValueError, match=r"layer_types marks sliding_attention layers but "
                                         r"use_sliding_window=None"):
        smollm3_layer_windows({**base, "layer_types": types}, 4)


def test_gemma_legacy_gelu_is_the_tanh_gelu_and_others_are_refused(tiny_models, tmp_path):
    """The Hub's Gemma configs say hidden_act "gelu"; GemmaConfig serves it as the tanh GeLU."""
    path = tiny_models("gemma")
    ids = torch.arange(19) * 37 % 500 + 3
    legacy = load(with_config(path, tmp_path / "gelu", hidden_act="gelu"))
    torch.testing.assert_close(prefill_logits(legacy, ids), hf_logits(hf_model(path), ids),
                               rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match=r"hidden_act='silu' is not supported for "
                                         r"GemmaForCausalLM: must be one of"):
        load(with_config(path, tmp_path / "silu", hidden_act="silu"))
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=true is not supported"):
        load(with_config(path, tmp_path / "bidi", use_bidirectional_attention=True))


def test_gemma_defaults_are_gemma_configs(tiny_models):
    """Without head_dim and tie_word_embeddings in config.json: GemmaConfig's 256 and tied."""
    cfg = json.load(open(f"{tiny_models('gemma')}/config.json"))
    assert cfg["tie_word_embeddings"] and cfg["head_dim"] == 16
    bare = {k: v for k, v in cfg.items() if k not in ("head_dim", "tie_word_embeddings")}
    model = GemmaForCausalLM(bare, single_rank_group(), BACKEND, torch.float32)
    assert model.head_dim == 256 and model.lm_head_is_tied

