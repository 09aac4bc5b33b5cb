"""An engine that goes idle still tells the workers which requests finished.

Finished requests reach the workers in the next step's diff; when no step follows (the server
goes idle), the engine sends one that computes nothing and carries only the finished handles
(engine_core.EngineCore.has_work), so the worker drops their cached state (token lists, grammar
matchers, sampler state) without waiting for a new request. The real in-process runner on a tiny
model, behind the AsyncEngine the server runs; with and without async scheduling.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.output_processor import OutputProcessor

PROMPTS = {"a": [5, 17, 33, 2, 9], "b": [7, 7, 41, 3], "c": [11, 12, 13, 14, 15, 16]}
DEADLINE_S = 120.0      # generous: a loaded 2-core machine; the condition is an event


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_idle_engine_drops_finished_requests_on_the_worker(tiny_models, async_scheduling):
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=64, max_num_seqs=8,
              async_scheduling=async_scheduling)
    runner = llm.runner
    # Steps that ran the model (its forward and sampling): the dropping step must not.
    forward_steps = []
    launch = runner._launch

    def counting_launch(step, *args):
        forward_steps.append(step)
        return launch(step, *args)
    runner._launch = counting_launch

    # The cache count goes from 0 to more only when requests arrive and back to 0 only by a
    # step that carries finished handles and no request: the one this test is about.
    seen = {"cached": False}
    dropped = threading.Event()

    def on_turn():                      # the engine thread, after every loop turn
        if runner.requests:
            seen["cached"] = True
        elif seen["cached"]:
            dropped.set()

    engine = AsyncEngine(lambda: llm.engine.core, lambda: OutputProcessor(llm.tokenizer),
                         on_turn=on_turn)
    engine.start()

    async def run(rid: str) -> list[int]:
        tokens = []
        stop = StoppingParams(max_tokens=2 if rid == "b" else 8, ignore_eos=True)
        async for out in engine.generate(Request(rid, PROMPTS[rid], SamplingParams(), stop)):
            tokens += out.new_token_ids
            if rid == "c" and len(tokens) >= 2:
                break                   # generate()'s cleanup aborts it
        return tokens

    async def main():
        assert await asyncio.to_thread(engine.wait_ready, 60), engine.last_error
        return await asyncio.gather(*(run(rid) for rid in PROMPTS))

    try:
        got = asyncio.run(main())
        assert [len(t) for t in got[:2]] == [8, 2] and len(got[2]) >= 2
        assert dropped.wait(DEADLINE_S), f"the worker still caches {len(runner.requests)} " \
                                         "finished requests with the engine idle"
        core = engine.core
        assert runner.requests == {} and runner.batch.num_reqs == 0
        assert not core.has_work() and not core.scheduler.has_finished_to_send()
        assert forward_steps and runner.last_step > max(forward_steps)
    finally:
        engine.shutdown()
