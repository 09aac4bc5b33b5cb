"""Phi-3 (Phi3ForCausalLM) against transformers on the same tiny random weights, float32 on the
CPU: the checkpoint's fused qkv_proj / gate_up_proj cut at load, a window of 8 on every layer
(worker_service/models/tiny_model.py "phi3"):

  - prefill logits through the paged cache equal transformers' forward, past the window,
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, with prefix-cache hits,
  - two gloo ranks (each with half of the heads and of the MLP) give the single rank's logits,
  - longrope scaling and a fused tensor of the wrong size are refused naming them.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.llm import LLM
from tests.support.engine_checks import _check, _prompts
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import assert_tp2_matches_tp1, load, prefill_logits
from worker_service.models.loader import WeightLoadError


def test_prefill_logits_match_transformers(tiny_models):
    path = tiny_models("phi3")
    ours = load(path)
    assert ours.layer_windows(json.load(open(f"{path}/config.json")), 2) == (8, 8)
    ids = torch.arange(41) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=1e-4)


def test_greedy_matches_transformers(tiny_models):
    model = tiny_models("phi3")
    llm = LLM(model, dtype="float32", num_kv_blocks=256)
    _check(llm, model, _prompts(llm.model_info.vocab_size), "phi3/plain")
    _check(llm, model, _prompts(llm.model_info.vocab_size), "phi3/prefix-hits")
    assert llm.scheduler.kv.stats.hits > 0


def test_chunked_prefill_matches_transformers(tiny_models):
    model = tiny_models("phi3")
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, model, _prompts(llm.model_info.vocab_size), "phi3/chunked")


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    from worker_service.models.tiny_model import make_tiny_model
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / "phi3", arch="phi3", seed=2)], tmp_path)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_longrope_is_refused_naming_it(tiny_models, tmp_path):
    path = _copy(tiny_models("phi3"), tmp_path / "longrope")
    cfg = json.load(open(f"{path}/config.json"))
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * 8,
                           "long_factor": [2.0] * 8}
    json.dump(cfg, open(f"{path}/config.json", "w"))
    with pytest.raises(ValueError, match="rope_type='longrope' is not supported"):
        load(path)


def test_a_fused_tensor_of_the_wrong_size_is_refused(tiny_models, tmp_path):
    path = _copy(tiny_models("phi3"), tmp_path / "short-qkv")
    weights = load_file(f"{path}/model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-16].contiguous()
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"qkv_proj.weight.*112 rows, expected 128"):
        load(path)
