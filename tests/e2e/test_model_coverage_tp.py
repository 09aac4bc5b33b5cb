"""SmolLM3 (NoPE layers), Gemma 1, StarCoder2 (window 8 on every layer) and Qwen3 with YaRN
served at TP=2 by a real worker service (two gloo rank processes, symmetry verification on)
give the in-process TP=1 engine's tokens, greedy and seeded sampling, prompts prefilled whole
and in chunks (tests/support/tp_harness.workload)."""
from __future__ import annotations

import pytest

from tests.support.tp_harness import engine_on, reference, run_requests, workload

YARN = {"max_position_embeddings": 256,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64}}
# name -> (arch, config overrides)
MODELS = {"smollm3": ("smollm3", {}), "gemma": ("gemma", {}),
          "starcoder2_window8": ("starcoder2", {"sliding_window": 8}),
          "qwen3_yarn": ("qwen3", YARN)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_matches_tp1(tp2, tiny_models, name):
    arch, overrides = MODELS[name]
    model = tiny_models(arch, **overrides)
    expected_tokens, _ = reference(model, *workload())
    with engine_on(tp2, model) as core:
        assert run_requests(core, model, *workload()) == expected_tokens
