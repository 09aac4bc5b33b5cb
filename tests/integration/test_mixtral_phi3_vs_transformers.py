"""Mixtral and Phi-3 against transformers on the same tiny random weights, float32 on the CPU
(worker_service/models/tiny_model.py): Mixtral with 2 layers each routing every token to 2 of 4
experts (renormalised); Phi-3 with the checkpoint's fused qkv_proj / gate_up_proj cut at load;
both with a sliding window of 8 on every layer.

  - prefill logits through the paged cache equal transformers' forward, past the window,
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, with prefix-cache hits,
  - two gloo ranks (half of the heads, of the MLP, of every expert) give the single rank's logits,
  - Phi-3's LongRoPE: generate()'s tokens within the original length, transformers' cached
    one-token forward past it,
  - a Mixtral config without experts, longrope factors and a fused tensor of the wrong size are
    refused naming them.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.llm import LLM
from engine_common.model_files.moe_config import moe_config_problem
from tests.support.engine_checks import (_check, _prompts, check_chunked_greedy,
                                         check_greedy_and_prefix_hits)
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import assert_tp2_matches_tp1, load, prefill_logits
from worker_service.models.loader import WeightLoadError

ARCHS = ("mixtral", "phi3")


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_models, arch):
    path = tiny_models(arch)
    ours = load(path)
    assert ours.layer_windows(json.load(open(f"{path}/config.json")), 2) == (8, 8)
    if arch == "mixtral":
        assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["SparseMoeBlock"] * 2
    ids = torch.arange(41) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_models, arch):
    check_greedy_and_prefix_hits(tiny_models(arch), arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_transformers(tiny_models, arch):
    check_chunked_greedy(tiny_models(arch), arch)


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    from worker_service.models.tiny_model import make_tiny_model
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / arch, arch=arch, seed=2)
                            for arch in ARCHS], tmp_path)


@pytest.mark.parametrize("experts", [0, None])
def test_mixtral_without_experts_is_refused(experts):
    cfg = {"architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
           "num_experts_per_tok": 2, "intermediate_size": 48}
    assert moe_config_problem(cfg) == "num_local_experts=0 is invalid: must be >= 1"
    no_width = {**cfg, "num_local_experts": 4, "intermediate_size": None}
    assert moe_config_problem(no_width) == "intermediate_size=None is invalid: must be >= 1"
    bad = {**no_width, "intermediate_size": "48"}
    assert moe_config_problem(bad) == "intermediate_size='48' is invalid: must be an integer"


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


# LongRoPE (Phi-3.5-mini's scaling) on the tiny Phi-3: 16 original positions of 64, distinct
# short and long factors.
LONGROPE = {"max_position_embeddings": 64, "original_max_position_embeddings": 16,
            "sliding_window": None,
            "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                             "long_factor": [2.0 + i for i in range(8)]}}


def test_phi3_longrope_matches_transformers(tiny_models):
    """Within the original length: the engine's greedy tokens are generate()'s. Past it: every
    position's logits are those of transformers' forward decoding one token at a time on its
    cache (short factors below 16, long from 16 on). transformers' generate() instead drops its
    cache once a sequence crosses 16 and recomputes everything long (Phi3ForCausalLM's
    prepare_inputs_for_generation), which a paged cache does not do (docs/models-and-chat.md)."""
    model = tiny_models("phi3", **LONGROPE)
    cfg = json.load(open(f"{model}/config.json"))
    assert (cfg.get("rope_parameters") or cfg.get("rope_scaling"))["rope_type"] == "longrope"
    llm = LLM(model, dtype="float32", num_kv_blocks=64)
    _check(llm, model, [p[:4] for p in _prompts(llm.model_info.vocab_size)], "phi3/longrope")
    hf = hf_model(model)
    ids = torch.arange(24) * 37 % 500 + 3
    with torch.no_grad():
        out = hf(ids[None, :16], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[0]]
        for t in range(16, 24):
            out = hf(ids[None, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0])
    expected = torch.cat(steps).float()
    torch.testing.assert_close(prefill_logits(load(model), ids), expected, rtol=0, atol=1e-4)


def test_phi3_longrope_factors_of_the_wrong_length_are_refused(tiny_models, tmp_path):
    path = _copy(tiny_models("phi3", **LONGROPE), tmp_path / "short-factors")
    cfg = json.load(open(f"{path}/config.json"))
    rope = cfg.get("rope_parameters") or cfg["rope_scaling"]
    rope["short_factor"] = [1.0] * 3
    json.dump(cfg, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match=r"rope short_factor=3 is invalid: must be a list of "
                                         r"rotary_dim / 2 = 8 numbers"):
        load(path)


def test_phi3_fused_tensor_of_the_wrong_size_is_refused(tiny_models, tmp_path):
    path = _copy(tiny_models("phi3"), tmp_path / "short-qkv")
    weights = load_file(f"{path}/model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-16].contiguous()
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"qkv_proj.weight.*112 rows, expected 128"):
        load(path)
