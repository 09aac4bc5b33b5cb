"""OLMo 2 and Granite served at TP=2 by a real worker service (two gloo rank processes, symmetry
verification on) give the in-process TP=1 engine's tokens, greedy and seeded sampling, prompts
prefilled whole and in chunks (tests/support/tp_harness.workload). OLMo 2's q/k norm spans the
ranks (an all-reduce of the sum of squares in every layer), with its kv heads split (2 heads)
and replicated (1 head on 2 ranks); Granite's multipliers are per-rank constants.
"""
from __future__ import annotations

import pytest

from tests.support.tp_harness import engine_on, reference, run_requests, workload

# name -> (arch, config overrides)
MODELS = {"olmo2": ("olmo2", {}), "olmo2_kv1": ("olmo2", {"num_key_value_heads": 1}),
          "granite": ("granite", {})}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_matches_tp1(tp2, tiny_models, name):
    arch, overrides = MODELS[name]
    model = tiny_models(arch, **overrides)
    expected_tokens, _ = reference(model, *workload())
    with engine_on(tp2, model) as core:
        assert run_requests(core, model, *workload()) == expected_tokens
