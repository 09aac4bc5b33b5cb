"""A Mistral with a window of 8 on every layer served at TP=2 by a real worker service (two gloo
rank processes, symmetry verification on): Init reports the window over gRPC, and the scheduler
frees the blocks that left it from a pool too small for the requests otherwise (the KV blocks of
a running request are reused by others while its ranks' tables still name them). The tokens
equal the in-process TP=1 engine's with the same pool, greedy and seeded sampling alike.
"""
from __future__ import annotations

import pytest

from engine_common.request.params import StoppingParams
from tests.support.tp_harness import LIMITS, engine_on, reference, run_requests, workload

WINDOW = 8
NUM_BLOCKS = 20        # 80 tokens; requests reach 96 (max_model_len), eight run at once


@pytest.mark.slow
def test_tp2_frees_blocks_that_left_the_window_as_tp1_does(tp2, tiny_models):
    model = tiny_models("mistral", seed=4, sliding_window=WINDOW)
    prompts, samplings, _ = workload()
    stoppings = [StoppingParams(max_tokens=LIMITS["max_model_len"] - len(p), ignore_eos=True)
                 for p in prompts]
    expected, _ = reference(model, prompts, samplings, stoppings, num_blocks=NUM_BLOCKS)
    assert [len(t) for t in expected] == [s.max_tokens for s in stoppings]
    with engine_on(tp2, model, num_blocks=NUM_BLOCKS) as core:
        sched = core.scheduler
        assert sched.kv.sliding_window == WINDOW        # from InitResponse.sliding_window
        assert run_requests(core, model, prompts, samplings, stoppings) == expected
        assert sched.num_free_blocks == NUM_BLOCKS
