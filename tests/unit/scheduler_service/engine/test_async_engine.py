"""AsyncEngine, torch-free: the engine thread steps a SimWorker-backed EngineCore and hands each
turn's token updates to the event loop in one call; the loop's StreamHub makes the text and
sends stop-string matches back. Streams must end exactly as in the one-thread LLMEngine (ids,
text, finish and stop reason, usage) although the engine hears of a stop string late, the blocks
must all come back, and the loop must be woken once per step, not once per stream; a lagging
reader gets what waited for it as one output. A failing worker and a fenced scheduler:
test_async_engine_failures.py.
"""
from __future__ import annotations

import asyncio
import random
import threading

import pytest

from engine_common.wire.codec import (decode_scheduler_output, encode_runner_output)
from engine_common.configuration.config import SchedulerConfig
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.admission import RequestRejected
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.engine.stream_hub import StreamHub
from scheduler_service.engine.metrics import SchedulerMetrics
from scheduler_service.engine.serving_counters import ServingCounters
from tests.support.scheduler_sim import SimWorker

EOS = 1          # "</s>" in the tiny tokenizer
STOPS = ("e", "th", "a", " t", "in", "o")
NUM_BLOCKS = 24


def sample(state) -> int:
    """A token of the tiny vocabulary from the seed and the sequence; about 1 in 50 is eos."""
    h = hash((state.seed, tuple(state.tokens)))
    return EOS if h % 50 == 0 else h % 300 + 2


class SimExecutor:
    """SimWorker behind the byte-level executor interface; `collect` runs a submitted step."""

    def __init__(self, num_blocks: int):
        self.worker = SimWorker(num_blocks, 4, sample_fn=sample)

    def execute(self, payload: bytes) -> bytes:
        return encode_runner_output(self.worker.execute(decode_scheduler_output(payload)))

    def submit(self, payload: bytes) -> bytes:
        return payload

    def collect(self, ticket: bytes) -> bytes:
        return self.execute(ticket)


def make_core(async_scheduling: bool, max_num_seqs: int = 4,
              num_blocks: int = NUM_BLOCKS) -> EngineCore:
    config = SchedulerConfig(block_size=4, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=16 * max_num_seqs, max_model_len=128,
                             async_scheduling=async_scheduling)
    return EngineCore(Scheduler(config, num_blocks, rng=random.Random(0)),
                      SimExecutor(num_blocks))


def workload(tok, seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    texts = ["The quick brown fox", "Paged attention keeps", "def add(a, b):", "héllo wörld"]
    reqs = []
    for i in range(n):
        max_tokens = rng.randrange(1, 20)
        stopping = StoppingParams(
            max_tokens=max_tokens, min_tokens=rng.randrange(min(3, max_tokens) + 1),
            stop=tuple(rng.sample(STOPS, rng.randrange(4))), ignore_eos=rng.random() < 0.2,
            include_stop_str_in_output=rng.random() < 0.3)
        reqs.append(Request(f"r{i}", tok.encode(rng.choice(texts)), SamplingParams(seed=i),
                            stopping, eos_token_ids=(EOS,), arrival_time=float(i)))
    return reqs


def copies(reqs: list[Request]) -> list[Request]:
    return [Request(r.request_id, list(r.prompt_token_ids), r.sampling, r.stopping,
                    r.eos_token_ids, arrival_time=r.arrival_time) for r in reqs]


def summary(outs) -> tuple:
    """(ids, text, finish reason, stop reason, usage) of one request's outputs."""
    last = outs[-1]
    return ([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
            last.finish_reason, last.stop_reason, last.num_output_tokens)


def run_one_thread(tok, reqs: list[Request]) -> dict[str, tuple]:
    engine = LLMEngine(make_core(False), OutputProcessor(tok))
    got = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(out)
    return {rid: summary(outs) for rid, outs in got.items()}


WAIT_S = 30.0    # a bound on a wait for an event, never reached in a passing run


async def _until_ready(engine: AsyncEngine) -> None:
    assert await asyncio.to_thread(engine.wait_ready, WAIT_S), engine.last_error


class TurnWatch:
    """The engine's on_turn hook: wakes whoever waits for a condition on the engine's state,
    which the engine thread publishes before each turn ends."""

    def __init__(self):
        self._turned = threading.Condition()

    def __call__(self) -> None:
        with self._turned:
            self._turned.notify_all()

    def wait_for(self, predicate) -> bool:
        with self._turned:
            return self._turned.wait_for(predicate, WAIT_S)


async def _stream_all(engine: AsyncEngine, reqs: list[Request]) -> dict[str, tuple]:
    await _until_ready(engine)

    async def one(request: Request):
        return request.request_id, summary([out async for out in engine.generate(request)])

    return dict(await asyncio.gather(*(one(r) for r in reqs)))


async def _until_idle(engine: AsyncEngine, turns: TurnWatch) -> None:
    """The engine frees a stop-string request when the loop's finish command reaches it."""
    def idle() -> bool:
        s = engine.stats
        return s.num_used_blocks == 0 and s.num_running == 0 and s.num_waiting == 0

    assert await asyncio.to_thread(turns.wait_for, idle), f"blocks still held: {engine.stats}"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streams_match_the_one_thread_engine(tok, async_scheduling):
    seen = {"stop_string": 0, "stop_token": 0}
    cores: list[EngineCore] = []

    def new_core():
        cores.append(make_core(async_scheduling))
        return cores[-1]

    turns = TurnWatch()
    engine = AsyncEngine(new_core, lambda: OutputProcessor(tok), on_turn=turns)
    engine.start()
    try:
        for seed in range(12):
            reqs = workload(tok, seed, 10)
            want = run_one_thread(tok, copies(reqs))

            async def scenario():
                got = await _stream_all(engine, reqs)
                await _until_idle(engine, turns)
                return got

            got = asyncio.run(scenario())
            assert got == want, seed
            seen["stop_string"] += sum(w[2] == RequestStatus.FINISHED_STOP_STRING
                                       for w in want.values())
            seen["stop_token"] += sum(w[2] == RequestStatus.FINISHED_STOP_TOKEN
                                      for w in want.values())
    finally:
        engine.shutdown()
    assert len(cores) == 1, "no step may fail"
    assert seen["stop_string"] > 10 and seen["stop_token"] > 2, seen


def test_one_hand_off_per_step_whatever_the_number_of_streams(tok):
    """32 streams decoding together: the loop is woken at most once per engine step."""
    core = make_core(False, max_num_seqs=32, num_blocks=32 * 4)
    steps = {"n": 0}
    real_step = core.step

    def counted_step():
        steps["n"] += 1
        return real_step()

    core.step = counted_step
    engine = AsyncEngine(lambda: core, lambda: OutputProcessor(tok))
    reqs = [Request(f"s{i}", tok.encode("The quick brown fox")[:4] + [10 + i],
                    SamplingParams(seed=i), StoppingParams(max_tokens=8, ignore_eos=True))
            for i in range(32)]

    async def scenario():
        loop = asyncio.get_running_loop()
        wakeups = {"n": 0}
        real_call = loop.call_soon_threadsafe

        def counted_call(callback, *args, **kwargs):
            # The engine's hand-offs; asyncio.to_thread (waiting for readiness) also calls back.
            wakeups["n"] += getattr(callback, "__name__", "") == "deliver"
            return real_call(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted_call
        got = await _stream_all(engine, reqs)
        return got, wakeups["n"]

    engine.start()
    try:
        got, wakeups = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert all(len(g[0]) == 8 and g[2] == RequestStatus.FINISHED_LENGTH for g in got.values())
    assert 8 <= steps["n"] and wakeups <= steps["n"], (wakeups, steps)


def test_tokens_computed_after_a_stop_string_never_reach_the_stream(tok):
    """The hub finds a stop string in step t's update; the engine, not told yet, runs step t+1
    for that request too. Its token is dropped, and the finish command frees the blocks."""
    core = make_core(False)
    finish_commands = []
    loop = asyncio.new_event_loop()
    try:
        hub = StreamHub(loop, OutputProcessor(tok), lambda ids, st: finish_commands.append(
            (ids, st)), ServingCounters(), SchedulerMetrics("m"))
        stopping = StoppingParams(max_tokens=30, stop=STOPS, ignore_eos=True)
        request = Request("x", tok.encode("The quick"), SamplingParams(seed=3), stopping)
        outputs = hub.open(request)
        core.add_request(request)
        for _ in range(30):
            if finish_commands:
                break
            hub.deliver(core.step())
        hub.deliver(core.step())            # the engine is a step late
        ids, status = finish_commands[0]
        core.scheduler.finish_requests(ids, status)
        got = outputs.take_nowait()
    finally:
        loop.close()
    assert ids == ["x"] and status == RequestStatus.FINISHED_STOP_STRING
    assert got[-1].finished and got[-1].finish_reason == RequestStatus.FINISHED_STOP_STRING
    sent = sum(len(o.new_token_ids) for o in got)
    assert sent == got[-1].num_output_tokens < request.num_output_tokens   # one more computed
    assert core.scheduler.num_free_blocks == NUM_BLOCKS and len(finish_commands) == 1
    assert summary(got) == run_one_thread(tok, copies([request]))["x"]


def test_a_second_stream_with_a_live_id_is_rejected_on_the_loop(tok):
    loop = asyncio.new_event_loop()
    try:
        hub = StreamHub(loop, OutputProcessor(tok), lambda ids, st: None, ServingCounters(),
                        SchedulerMetrics("m"))
        request = Request("dup", [5, 6, 7], SamplingParams(), StoppingParams(max_tokens=4))
        hub.open(request)
        with pytest.raises(RequestRejected, match="request_id='dup' must be unique"):
            hub.open(Request("dup", [8], SamplingParams(), StoppingParams(max_tokens=4)))
    finally:
        loop.close()


def test_a_lagging_reader_gets_the_waiting_steps_as_one_output(tok):
    """A caller that reads after the request has finished gets what waited for it as one
    output (one gRPC message instead of one per step), with the same ids, text and usage."""
    turns = TurnWatch()
    engine = AsyncEngine(lambda: make_core(False), lambda: OutputProcessor(tok), on_turn=turns)
    req = Request("lag", tok.encode("The quick brown fox"), SamplingParams(seed=3),
                  StoppingParams(max_tokens=6, ignore_eos=True))
    want = run_one_thread(tok, copies([req]))["lag"]

    async def scenario():
        await _until_ready(engine)
        stream = engine.generate(req)
        first = await stream.__anext__()
        await _until_idle(engine, turns)  # finished: its later steps wait in the queue
        return [first] + [out async for out in stream]

    engine.start()
    try:
        outs = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert len(outs) <= 2 and outs[-1].finished
    assert summary(outs) == want and len(want[0]) == 6
