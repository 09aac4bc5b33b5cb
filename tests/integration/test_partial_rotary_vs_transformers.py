"""Partial rotary (Phi-4-mini: Phi3ForCausalLM with partial_rotary_factor 0.75) against
transformers on the tiny Phi-3 (head_dim 16, so the first 12 dims of each head rotate and 4
pass through), float32 on the CPU, with and without LongRoPE (6 factors each):

  - prefill logits through the paged cache equal transformers' forward,
  - the engine's greedy tokens equal generate()'s, chunked and with prefix-cache hits,
  - both on the C++ rope (kernels/cpu, which rotates the first rotary_dim dims as torch does)
    whenever the library is built: the test asserts it ran,
  - a factor outside (0, 1] or one leaving an odd rotary_dim is refused naming it.
"""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from tests.support.cpu_rope_spy import count_cpu_ropes
from tests.support.engine_checks import _check, _prompts
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import assert_tp2_matches_tp1, load, prefill_logits
from worker_service.layers.rotary import RopeSettings

PARTIAL = {"partial_rotary_factor": 0.75, "sliding_window": None}
LONGROPE = {**PARTIAL, "max_position_embeddings": 64, "original_max_position_embeddings": 16,
            "rope_scaling": {"rope_type": "longrope",
                             "short_factor": [1.0 + i / 8 for i in range(6)],
                             "long_factor": [2.0 + i for i in range(6)]}}


@pytest.mark.parametrize("overrides", [PARTIAL, LONGROPE], ids=["default", "longrope"])
def test_prefill_logits_match_transformers(tiny_models, overrides):
    path = tiny_models("phi3", **overrides)
    ours = load(path)
    rope = ours.model.layers[0].self_attn.rotary_emb
    assert (rope.head_dim, rope.rotary_dim, rope.cos_cache.shape[-1]) == (16, 12, 12)
    spy = count_cpu_ropes(rope)
    ids = torch.arange(15) * 37 % 500 + 3          # within LongRoPE's 16 original positions
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=1e-4)
    assert spy is None or spy.calls == len(ours.model.layers), "every layer on the C++ rope"


def test_greedy_matches_transformers_chunked_and_prefix_hits(tiny_models):
    model = tiny_models("phi3", **PARTIAL)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    spy = count_cpu_ropes(llm.runner.model.model.layers[0].self_attn.rotary_emb)
    _check(llm, model, _prompts(llm.model_info.vocab_size), "phi4mini/chunked")
    _check(llm, model, _prompts(llm.model_info.vocab_size), "phi4mini/prefix-hits")
    assert llm.scheduler.kv.stats.hits > 0
    assert spy is None or spy.calls > 0, "the engine's steps ran the C++ rope"


@pytest.mark.parametrize("factor", [0, 1.5, "0.5", True])
def test_factor_outside_the_range_is_refused(factor):
    with pytest.raises(ValueError, match=rf"partial_rotary_factor={factor!r} is invalid: "
                                         r"must be a number in \(0, 1\]"):
        RopeSettings.from_hf_config({"partial_rotary_factor": factor})


def test_factor_leaving_an_odd_rotary_dim_is_refused():
    settings = RopeSettings.from_hf_config({"rope_parameters": {"partial_rotary_factor": 0.3}})
    assert settings.rotary_dim(20) == 6
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.3 is invalid for head_dim=10: "
                                         r"int\(head_dim \* factor\) = 3 must be an even"):
        settings.rotary_dim(10)


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    """Rope is per head: each rank rotates the first 12 dims of its half of the heads."""
    from worker_service.models.tiny_model import make_tiny_model
    assert_tp2_matches_tp1([make_tiny_model(tmp_path / "phi4mini", arch="phi3", seed=2,
                                            **PARTIAL)], tmp_path)
