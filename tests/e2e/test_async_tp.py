"""Async scheduling (two steps in flight) against a real TP=2 layout: two worker services of one
rank each, gloo on CPU, symmetry verification on, so every step both nodes must agree on their
sampled ids and cached state while the next step is already queued on their Step streams.
Requests aborted mid-flight must not disturb the others, which equal the TP=1 synchronous
reference token for token, and the workers must end holding no request.
"""
from __future__ import annotations

import dataclasses

from engine_common.model_files.model_dir import ModelInfo
from scheduler_service.core.request import Request, RequestStatus
from tests.support.tp_harness import engine_on, reference, scheduler_config, workload

ABORT_AT = {3: "r1", 6: "r4"}     # engine step -> request aborted after it


def test_async_tp2_with_aborts_matches_tp1(tp2_two_nodes, tiny_models):
    model = tiny_models("llama")
    prompts, samplings, stoppings = workload()
    expected, _ = reference(model, prompts, samplings, stoppings)
    config = dataclasses.replace(scheduler_config(), async_scheduling=True)
    with engine_on(tp2_two_nodes, model, config) as core:
        eos = ModelInfo.from_dir(model).eos_token_ids
        tokens, reasons = {}, {}
        for i, (p, sp, st) in enumerate(zip(prompts, samplings, stoppings)):
            tokens[f"r{i}"] = []
            core.add_request(Request(f"r{i}", list(p), sp, st, eos))
        num_steps = 0
        while core.has_unfinished_requests():
            outs = core.step()
            num_steps += 1
            if num_steps in ABORT_AT:
                assert core.core._in_flight, "the abort must land while a step is in flight"
                outs += core.abort([ABORT_AT[num_steps]])
            for out in outs:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
    for i, want in enumerate(expected):
        rid = f"r{i}"
        if rid in ABORT_AT.values():
            assert reasons[rid] == RequestStatus.FINISHED_ABORTED
            assert len(tokens[rid]) < len(want) and tokens[rid] == want[:len(tokens[rid])], rid
        else:
            assert tokens[rid] == want and reasons[rid] == RequestStatus.FINISHED_LENGTH, rid
