"""GLM-4 (half-rotary interleaved rope, q/k rows reordered at load), Cohere with per-head q/k
LayerNorms (their weights sliced per rank) and Cohere2 (sliding layers with rope, a full layer
without) served at TP=2 by a real worker service (two gloo rank processes, symmetry
verification on) give the in-process TP=1 engine's tokens, greedy and seeded sampling, prompts
prefilled whole and in chunks (tests/support/tp_harness.workload)."""
from __future__ import annotations

import pytest

from tests.support.tp_harness import engine_on, reference, run_requests, workload

MODELS = ("glm4", "cohere", "cohere2")


@pytest.mark.slow
@pytest.mark.parametrize("arch", MODELS)
def test_tp2_matches_tp1(tp2, tiny_models, arch):
    model = tiny_models(arch)
    expected_tokens, _ = reference(model, *workload())
    with engine_on(tp2, model) as core:
        assert run_requests(core, model, *workload()) == expected_tokens
