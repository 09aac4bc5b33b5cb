"""A hybrid KV cache (engine_common/request/kv_groups.py) served at TP=2 by a real worker
service (two gloo rank processes, symmetry verification on): the tiny Gemma 2 (window 8 / full
layers alternating) reports its window group in Init, the diffs carry its tables, and the
tokens are the in-process TP=1 engine's (greedy and seeded sampling, chunked prefills)."""
from __future__ import annotations

import pytest

from engine_common.request.kv_groups import window_pool_bound
from tests.support.tp_harness import (BLOCK_SIZE, LIMITS, engine_on, reference, run_requests,
                                      workload)


@pytest.mark.slow
def test_tp2_hybrid_cache_matches_tp1(tp2, tiny_models):
    model = tiny_models("gemma2")
    expected_tokens, payloads = reference(model, *workload())
    with engine_on(tp2, model) as core:
        group = core.scheduler.kv.window_group
        assert (group.sliding_window, group.num_total_blocks) == (8, window_pool_bound(
            8, BLOCK_SIZE, LIMITS["max_num_seqs"], LIMITS["max_num_batched_tokens"]))
        sent = []
        schedule = core.scheduler.schedule

        def spy():
            out = schedule()
            sent.append(out.new_window_block_ids)
            return out
        core.scheduler.schedule = spy
        assert run_requests(core, model, *workload()) == expected_tokens
        assert any(sent)
