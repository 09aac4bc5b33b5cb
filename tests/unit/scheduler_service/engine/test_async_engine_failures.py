"""AsyncEngine, torch-free, when the workers fail or another scheduler takes them over: a failed
worker drops readiness before the streams hear of it; a fenced engine (at connect or mid-step)
fails every stream, stops for good and never builds another core; a prefix-cache flush without a
worker answers at once and names why.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc

from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.api.status import status_for
from scheduler_service.core.request import Request
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.engine.stream_hub import StreamError, StreamHub
from scheduler_service.errors import EngineFault, EngineUnavailable, Fenced

EOS = 1                 # "</s>" in the tiny tokenizer
WAIT_S = 30.0           # a bound on a wait for an event, never reached in a passing run
TINY_RETRY_S = 0.001    # the engine's pause between tries to build a core


async def _until_ready(engine: AsyncEngine) -> None:
    assert await asyncio.to_thread(engine.wait_ready, WAIT_S), engine.last_error


async def _turns_of_the_loop(engine: AsyncEngine, n: int = 3) -> list[tuple[bool, str]]:
    """n flushes, each sent after the last was answered: the engine thread went round its
    loop at least n times (an unfenced engine tries to build a core on every one of them)."""
    return [await asyncio.wrap_future(engine.flush_prefix_cache(0)) for _ in range(n)]


_SCHED = SimpleNamespace(num_waiting=0, num_running=0, num_total_blocks=1, num_free_blocks=1,
                         prefix_cache_hit_rate=0.0, window_blocks=(0, 0), lora_cache=None)


class FailingCore:
    """Takes requests; its first step fails the way a timed-out worker does."""

    scheduler = _SCHED
    num_steps_in_flight = 0
    max_steps_in_flight = 2         # EngineCore's depth, which the status publishes

    def __init__(self, error: Exception):
        self.error = error
        self.requests = []

    def add_request(self, request):
        self.requests.append(request)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def has_work(self):
        return bool(self.requests)

    def step(self):
        raise self.error

    def abort(self, ids):
        return []


def _one_failing_core(error: Exception):
    """A core factory: a FailingCore raising `error` first, then an unreachable worker."""
    cores = iter([FailingCore(error)])

    def make_core():
        core = next(cores, None)
        if core is None:
            raise EngineUnavailable("worker not reachable")
        return core
    return make_core


def _request(rid: str) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(), StoppingParams(max_tokens=4), (EOS,))


async def _first_error(engine: AsyncEngine, rid: str):
    try:
        async for _ in engine.generate(_request(rid)):
            pass
    except EngineUnavailable as e:
        return e
    return None


def _run_engine(engine: AsyncEngine, scenario, timeout: float = 60):
    engine.start()
    try:
        return asyncio.run(asyncio.wait_for(scenario(), timeout))
    finally:
        engine.shutdown()


def test_readiness_drops_before_the_failed_streams_hear_of_it(tok, monkeypatch):
    """A caller that reacts to its stream's error at once must already see ready False: the
    flaky step-timeout e2e test sent its next request into the dead core, which failed with the
    old "no reply to step N in time" although the engine had said it was ready."""
    seen = []
    deliver = StreamHub.deliver

    def recording_deliver(hub, items):
        seen.extend(engine.ready for item in items if isinstance(item, StreamError))
        deliver(hub, items)

    monkeypatch.setattr(StreamHub, "deliver", recording_deliver)
    make_core = _one_failing_core(EngineUnavailable("no reply to step 11 in time"))
    engine = AsyncEngine(make_core, lambda: OutputProcessor(tok), reconnect_seconds=TINY_RETRY_S)

    async def scenario():
        await _until_ready(engine)
        return await _first_error(engine, "a"), engine.ready

    error, ready_after = _run_engine(engine, scenario)
    assert "step 11" in str(error) and seen == [False] and not ready_after


def test_a_fenced_engine_stops_for_good(tok):
    calls = []

    def make_core():
        calls.append(1)
        raise Fenced("worker w is driven by scheduler B since epoch 9")

    engine = AsyncEngine(make_core, lambda: OutputProcessor(tok), reconnect_seconds=TINY_RETRY_S)

    async def scenario():
        # The thread's first turn tries to build a core, so every answer comes after the fence.
        return await _turns_of_the_loop(engine), await _first_error(engine, "a")

    flushes, error = _run_engine(engine, scenario)
    assert calls == [1] and "driven by scheduler B" in str(error) and not engine.ready
    assert all(not ok and "driven by scheduler B" in why for ok, why in flushes), flushes


def test_fenced_mid_step_fails_the_streams_and_never_reconnects(tok):
    cores = [FailingCore(Fenced("step 3 failed: STALE_EPOCH: scheduler B took over"))]
    calls = []

    def make_core():
        calls.append(1)
        if cores:
            return cores.pop()
        raise AssertionError("a fenced engine must not build another core")

    engine = AsyncEngine(make_core, lambda: OutputProcessor(tok), reconnect_seconds=TINY_RETRY_S)

    async def scenario():
        await _until_ready(engine)
        first = await _first_error(engine, "a")
        await _turns_of_the_loop(engine)
        return first, await _first_error(engine, "b")

    first, second = _run_engine(engine, scenario)
    assert isinstance(first, Fenced) and "took over" in str(second) and calls == [1]
    assert engine.fenced and not engine.ready


def test_a_flush_without_a_worker_answers_at_once_and_names_why(tok):
    def make_core():
        raise EngineUnavailable("worker w:1 not reachable")

    engine = AsyncEngine(make_core, lambda: OutputProcessor(tok))

    async def scenario():
        return await asyncio.wrap_future(engine.flush_prefix_cache(60.0))

    assert _run_engine(engine, scenario) == (
        False, "not flushed: no worker is ready: worker w:1 not reachable")


def test_a_bug_in_a_step_reaches_the_streams_without_its_text(tok, caplog):
    """Every open stream, whoever's, hears of a failed step: a bug's exception text may name
    another tenant's request (here its scoped id), so the streams get its type only, and the
    log the whole of it. Before, every stream got `internal error: KeyError: '<the id>'`."""
    secret = "3f2a9c/tenant-b-private-request"
    make_core = _one_failing_core(KeyError(secret))
    engine = AsyncEngine(make_core, lambda: OutputProcessor(tok), reconnect_seconds=TINY_RETRY_S)

    async def scenario():
        await _until_ready(engine)
        try:
            async for _ in engine.generate(_request("a")):
                pass
        except Exception as e:  # noqa: BLE001 - the stream's error is what is checked
            return e, engine.last_error
        return None, engine.last_error

    error, last_error = _run_engine(engine, scenario)
    assert isinstance(error, EngineFault), error
    code, message = status_for(error)
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in message
    assert secret not in message and secret not in last_error
    assert secret in caplog.text                         # the operator still sees the cause
