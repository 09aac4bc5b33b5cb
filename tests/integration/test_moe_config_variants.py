"""MoE config variants real checkpoints use, against transformers' prefill logits on the same
tiny random weights (float32, CPU): the top-k at its bounds (1 expert a token; every expert) and
decoder_sparse_step 2 with no mlp_only_layers (Qwen2-MoE's odd layers sparse), and
top-k = every expert through the engine's greedy tokens."""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from tests.support.engine_checks import _check, _prompts
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import load, prefill_logits


@pytest.mark.parametrize("top_k", [1, 8])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_top_k_bounds_and_sparse_step_match_transformers(tiny_models, arch, top_k):
    path = tiny_models(arch, num_experts_per_tok=top_k, decoder_sparse_step=2, mlp_only_layers=[])
    model = load(path)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "DecoderMLP", "SparseMoeBlock", "DecoderMLP"]
    assert model.model.layers[1].mlp.gate.top_k == top_k
    ids = torch.arange(23) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(model, ids), expected, rtol=0, atol=1e-4)


def test_every_expert_per_token_greedy_matches_transformers(tiny_models):
    path = tiny_models("qwen2_moe", num_experts_per_tok=8)
    llm = LLM(path, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, path, _prompts(llm.model_info.vocab_size)[:5], "qwen2_moe/top8")
