"""--kv-cache-dtype fp8 at TP=2 over gloo (symmetry verification on): one worker of two ranks,
and two workers (nodes) of one rank each, whose Init replies must agree on the bytes of a block
(init_messages.shared_kv_block_bytes). The greedy tokens are transformers' with its keys and
values rounded to the same fp8 type (the reference of tests/unit/worker_service/runner/
test_kv_cache_dtype.py), where its top-2 margins leave room for float32 noise."""
from __future__ import annotations

import pytest
import torch

from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.tp_harness import engine_on, run_requests
from tests.unit.worker_service.runner.test_kv_cache_dtype import PROMPT, TIGHT, _hf_fp8_greedy

PROMPTS = [PROMPT, PROMPT + [7, 9, 11], list(range(40, 60))]
STEPS = 10


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["tp2", "tp2_two_nodes"])
def test_tp2_fp8_tokens_are_transformers_on_fp8_keys_and_values(request, tiny_models, cluster,
                                                                  monkeypatch):
    model = tiny_models("llama")
    refs = [_hf_fp8_greedy(model, p, STEPS, torch.float8_e4m3fn, monkeypatch) for p in PROMPTS]
    assert min(min(margins) for _, margins in refs) > 2 * TIGHT     # the premise
    stoppings = [StoppingParams(max_tokens=STEPS, ignore_eos=True)] * len(PROMPTS)
    with engine_on(request.getfixturevalue(cluster), model,
                   kv_cache_dtype="fp8_e4m3") as core:
        got = run_requests(core, model, PROMPTS, [SamplingParams()] * len(PROMPTS), stoppings)
    assert [tuple(g) for g in got] == [tokens for tokens, _ in refs]
