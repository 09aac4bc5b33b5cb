"""MoE config variants real checkpoints use, against transformers' prefill logits on the same
tiny random weights (float32, CPU): the top-k at its bounds (1 expert a token; every expert) and
decoder_sparse_step 2 with no mlp_only_layers (Qwen2-MoE's odd layers sparse), and
top-k = every expert through the engine's greedy tokens; and num_experts = 0, which both
architectures read as a dense model (every layer the MLP of width intermediate_size, Qwen2-MoE
without its shared expert), as transformers does."""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from tests.support.engine_checks import _check, _prompts
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import load, prefill_logits

# some tests compare the weights the loader writes, read back from the parameters
pytestmark = pytest.mark.usefixtures("keep_dense_weights")


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


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_zero_experts_is_the_dense_model_transformers_builds(tiny_models, arch):
    """transformers' Qwen2/Qwen3-MoE decoder layer is sparse only when num_experts > 0, so
    num_experts = 0 is a dense model: no router, no experts, no shared
    expert in either; the same logits on the same weights. Both names are read: transformers 5
    writes Qwen3-MoE's as num_local_experts, Qwen2-MoE's as num_experts."""
    path = tiny_models(arch, num_experts=0, num_experts_per_tok=0)
    reference = hf_model(path)
    assert not any("expert" in name or ".gate." in name
                   for name, _ in reference.named_parameters())
    model = load(path)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["DecoderMLP"] * 3
    ids = torch.arange(23) * 37 % 500 + 3
    with torch.no_grad():
        expected = reference(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(model, ids), expected, rtol=0, atol=1e-4)


def test_every_expert_per_token_greedy_matches_transformers(tiny_models):
    path = tiny_models("qwen2_moe", num_experts_per_tok=8)
    llm = LLM(path, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, path, _prompts(llm.model_info.vocab_size)[:5], "qwen2_moe/top8")
