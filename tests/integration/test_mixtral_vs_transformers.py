"""Mixtral against transformers on the same tiny random weights, float32 on the CPU: 2 layers,
each routing every token to 2 of 4 experts (renormalised), a sliding window of 8 on every layer
(worker_service/models/tiny_model.py "mixtral"):

  - prefill logits through the paged cache equal transformers' forward, past the window,
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, with prefix-cache hits,
  - two gloo ranks (each with half of every expert) give the single rank's logits,
  - a Mixtral config without experts is refused naming the key.
"""
from __future__ import annotations

import json

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.model_files.moe_config import moe_config_problem
from tests.support.engine_checks import _check, _prompts
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import assert_tp2_matches_tp1, load, prefill_logits


def test_prefill_logits_match_transformers(tiny_models):
    path = tiny_models("mixtral")
    ours = load(path)
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["SparseMoeBlock"] * 2
    assert ours.layer_windows(json.load(open(f"{path}/config.json")), 2) == (8, 8)
    ids = torch.arange(41) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=1e-4)


def test_greedy_matches_transformers(tiny_models):
    model = tiny_models("mixtral")
    llm = LLM(model, dtype="float32", num_kv_blocks=256)
    _check(llm, model, _prompts(llm.model_info.vocab_size), "mixtral/plain")
    # the same prompts again: whole-block prefix hits, then the same tokens
    _check(llm, model, _prompts(llm.model_info.vocab_size), "mixtral/prefix-hits")
    assert llm.scheduler.kv.stats.hits > 0


def test_chunked_prefill_matches_transformers(tiny_models):
    model = tiny_models("mixtral")
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, model, _prompts(llm.model_info.vocab_size), "mixtral/chunked")


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    """Each rank holds half of every expert's intermediate dim and half of the heads."""
    from worker_service.models.tiny_model import make_tiny_model
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / "mixtral", arch="mixtral", seed=2)],
                           tmp_path)


@pytest.mark.parametrize("experts", [0, None])
def test_mixtral_without_experts_is_refused(experts):
    cfg = {"architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
           "num_experts_per_tok": 2, "intermediate_size": 48}
    assert moe_config_problem(cfg) == "num_local_experts=0 is invalid: must be >= 1"
    no_width = {**cfg, "num_local_experts": 4, "intermediate_size": None}
    assert moe_config_problem(no_width) == "intermediate_size=None is invalid: must be >= 1"
    bad = {**no_width, "intermediate_size": "48"}
    assert moe_config_problem(bad) == "intermediate_size='48' is invalid: must be an integer"
