"""A request id is unique among unfinished requests only: once a stop string ended a stream on
the loop, its client may open a new stream with the same id before the engine (a step late) has
heard of the match. The old request's late updates must never reach the new stream."""
from __future__ import annotations

import asyncio

import pytest

from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.metrics import SchedulerMetrics
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.engine.serving_counters import ServingCounters
from scheduler_service.engine.stream_hub import StreamHub
from tests.unit.scheduler_service.engine.test_async_engine import (
    NUM_BLOCKS, STOPS, copies, make_core, run_one_thread, summary)


def _until_stop_string(tok, core: EngineCore, hub: StreamHub, finish_commands: list,
                       max_tokens: int) -> Request:
    """Stream "x" until the hub finds a stop string in it (the engine not told yet)."""
    old = Request("x", tok.encode("The quick"), SamplingParams(seed=3),
                  StoppingParams(max_tokens=max_tokens, stop=STOPS, ignore_eos=True))
    hub.open(old)
    core.add_request(old)
    while not finish_commands:
        hub.deliver(core.step())
    return old


@pytest.mark.parametrize("late_is_final", [False, True])
def test_a_late_token_of_a_stopped_request_never_reaches_a_new_stream_with_its_id(
        tok, late_is_final):
    """A stop string ends stream "x" on the loop; its client at once opens a new stream with the
    same id (legal: the old one is finished for it) before the engine, a step late, has heard of
    the match. The old request's token of that late step (its final update when that step
    reaches its max_tokens) belongs to the old request: the new stream gets none of it and ends
    exactly as it would alone. Before, it got the old token, or ended with the old finish."""
    core = make_core(False)
    finish_commands = []
    loop = asyncio.new_event_loop()
    try:
        hub = StreamHub(loop, OutputProcessor(tok), lambda ids, st: finish_commands.append(
            (ids, st)), ServingCounters(), SchedulerMetrics("m"))
        old = _until_stop_string(tok, core, hub, finish_commands, max_tokens=30)
        if late_is_final:       # the late step is its last
            old.stopping = StoppingParams(max_tokens=old.num_output_tokens + 1)
            old.max_num_output_tokens = old.num_output_tokens + 1
        new = Request("x", tok.encode("Paged attention"), SamplingParams(seed=5),
                      StoppingParams(max_tokens=4, ignore_eos=True))
        box = hub.open(new)                     # the client's retry, before the engine knows
        late = core.step()                      # the engine is a step late: old x's token
        assert [(u.request, u.finished) for u in late] == [(old, late_is_final)]
        hub.deliver(late)
        assert box.take_nowait() == []
        core.scheduler.finish_requests(*finish_commands[0])
        core.add_request(new)
        while core.has_unfinished_requests():
            hub.deliver(core.step())
        got = box.take_nowait()
    finally:
        loop.close()
    assert summary(got) == run_one_thread(tok, copies([new]))["x"]
    assert core.scheduler.num_free_blocks == NUM_BLOCKS
