"""EngineCore with async scheduling (driven by the one-thread LLMEngine), torch-free: SimWorker
behind the byte-level submit/collect interface, running each step only when it is collected (the
worker a whole step behind the scheduler, the other extreme from tests/test_scheduler_async.py
where it runs at once), the real OutputProcessor with stop strings, min_tokens, eos and
include_stop_str_in_output, requests arriving and being aborted between steps. Every request not
aborted must end exactly as in the synchronous engine (ids, text, finish and stop reason, usage),
an aborted one with a prefix of those ids, and nothing may be left on either side.
"""
from __future__ import annotations

import random
from collections import deque

import pytest

from engine_common.wire.codec import (decode_scheduler_output, encode_runner_output,
                                 encode_scheduler_output)
from engine_common.configuration.config import SchedulerConfig
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from tests.support.scheduler_sim import SimWorker

EOS = 1          # "</s>" in the tiny tokenizer
STOPS = ("e", "th", "a", " t", "in", "o")


def sample(state) -> int:
    """A token of the tiny vocabulary from the seed and the sequence; about 1 in 50 is eos."""
    h = hash((state.seed, tuple(state.tokens)))
    return EOS if h % 50 == 0 else h % 300 + 2


class LaggingExecutor:
    """`submit` queues a step; `collect` runs the queued steps in order up to that one."""

    def __init__(self, worker: SimWorker):
        self.worker = worker
        self.queued: deque = deque()
        self.results: dict[int, bytes] = {}
        self.log: list[tuple[str, int]] = []
        self._next = 0

    def execute(self, payload: bytes) -> bytes:
        return self._run(payload)

    def submit(self, payload: bytes) -> int:
        ticket, self._next = self._next, self._next + 1
        self.queued.append((ticket, payload))
        self.log.append(("submit", ticket))
        return ticket

    def collect(self, ticket: int) -> bytes:
        self.log.append(("collect", ticket))
        while ticket not in self.results:
            t, payload = self.queued.popleft()
            self.results[t] = self._run(payload)
        return self.results.pop(ticket)

    def _run(self, payload: bytes) -> bytes:
        return encode_runner_output(self.worker.execute(decode_scheduler_output(payload)))


def make_core(tok, async_scheduling: bool, num_blocks: int = 16, steps_in_flight: int = 2):
    config = SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                             max_model_len=128, async_scheduling=async_scheduling)
    executor = LaggingExecutor(SimWorker(num_blocks, 4, sample_fn=sample))
    core = EngineCore(Scheduler(config, num_blocks, rng=random.Random(0)), executor,
                      steps_in_flight=steps_in_flight)
    return LLMEngine(core, OutputProcessor(tok)), executor


def workload(tok, rng: random.Random, n: int) -> list[Request]:
    texts = ["The quick brown fox", "Paged attention keeps", "def add(a, b):", "héllo wörld"]
    reqs = []
    for i in range(n):
        max_tokens = rng.randrange(1, 20)
        stopping = StoppingParams(
            max_tokens=max_tokens, min_tokens=rng.randrange(min(3, max_tokens) + 1),
            stop=tuple(rng.sample(STOPS, rng.randrange(4))), ignore_eos=rng.random() < 0.2,
            include_stop_str_in_output=rng.random() < 0.3)
        reqs.append(Request(f"r{i}", tok.encode(rng.choice(texts)), SamplingParams(seed=i),
                            stopping, eos_token_ids=(EOS,), priority=rng.randrange(2),
                            arrival_time=float(i)))
    return reqs


def copies(reqs):
    return [Request(r.request_id, list(r.prompt_token_ids), r.sampling, r.stopping,
                    r.eos_token_ids, priority=r.priority, arrival_time=r.arrival_time)
            for r in reqs]


def run(tok, reqs, async_scheduling: bool, seed: int, abort_p: float = 0.0,
        steps_in_flight: int = 2):
    """request id -> [ids, text, finish reason, stop reason, usage], and the aborted ids."""
    core, executor = make_core(tok, async_scheduling, steps_in_flight=steps_in_flight)
    rng, waiting, aborted = random.Random(seed), list(reqs), set()
    got = {r.request_id: [[], "", None, None, 0] for r in reqs}

    def merge(outs):
        for out in outs:
            g = got[out.request_id]
            g[0] += out.new_token_ids
            g[1] += out.new_text
            g[4] = out.num_output_tokens
            if out.finished:
                g[2], g[3] = out.finish_reason, out.stop_reason
    while waiting or core.has_unfinished_requests():
        if waiting and (not core.has_unfinished_requests() or rng.random() < 0.5):
            core.add_request(waiting.pop(0))
        merge(core.step())
        assert core.core.num_steps_in_flight <= steps_in_flight
        live = sorted(core.scheduler._requests)
        if live and rng.random() < abort_p:
            aborted.add(rid := rng.choice(live))
            merge(core.abort([rid]))
    collected = [t for kind, t in executor.log if kind == "collect"]
    assert collected == sorted(collected) and len(collected) == len(executor.log) // 2
    assert not executor.queued and core.scheduler.num_free_blocks == 16
    executor.execute(encode_scheduler_output(core.scheduler.schedule()))
    assert executor.worker.reqs == {} and len(core.output_processor) == 0
    return got, aborted


@pytest.mark.parametrize("steps_in_flight", [2, 3])
def test_async_engine_core_matches_sync_with_stop_strings_and_aborts(tok, steps_in_flight):
    """Two steps in flight, and three (workers that pipeline their steps): a request that
    stops (eos, stop string) is computed for steps past its stop, whose tokens are dropped."""
    seen = {"stop_string": 0, "stop_token": 0, "aborted": 0}
    for seed in range(25):
        reqs = workload(tok, random.Random(seed), 10)
        want, _ = run(tok, copies(reqs), False, seed)
        for rid, (ids, _, reason, _, usage) in want.items():
            assert reason is not None and usage == len(ids)
            seen["stop_string"] += reason == RequestStatus.FINISHED_STOP_STRING
            seen["stop_token"] += reason == RequestStatus.FINISHED_STOP_TOKEN
        for abort_p in (0.0, 0.25):
            got, aborted = run(tok, copies(reqs), True, seed, abort_p, steps_in_flight)
            seen["aborted"] += len(aborted)
            for rid, g in got.items():
                if rid in aborted:
                    assert g[2] == RequestStatus.FINISHED_ABORTED and g[4] == len(g[0])
                    assert g[0] == want[rid][0][:len(g[0])], (seed, rid)
                else:
                    assert g == want[rid], (seed, rid, abort_p)
    assert seen["stop_string"] > 20 and seen["stop_token"] > 5 and seen["aborted"] > 20, seen


def test_step_semantics_with_two_steps_in_flight(tok):
    """The first step after an idle spell only submits; the request's last token arrives while
    one more step is in flight, so has_unfinished_requests stays true until a last step() that
    collects without scheduling anything."""
    core, executor = make_core(tok, True)
    core.add_request(Request("a", tok.encode("The quick"), SamplingParams(seed=1),
                             StoppingParams(max_tokens=3, ignore_eos=True)))
    assert core.step() == [] and executor.log == [("submit", 0)]
    outs = [core.step() for _ in range(3)]
    assert [len(o) for o in outs] == [1, 1, 1] and outs[-1][0].finished
    assert not core.scheduler.has_unfinished_requests() and core.has_unfinished_requests()
    assert core.step() == [] and executor.log[-1] == ("collect", 3)
    assert not core.has_unfinished_requests()
    assert executor.log.count(("submit", 4)) == 0
    # The last step computed nothing: the request's last token was already pending.
    assert executor.worker.step_tokens[-1] == {}


def test_step_semantics_with_three_steps_in_flight(tok):
    """Workers that pipeline their steps: the first two step() calls after an idle spell only
    submit, then each collects the oldest and submits one more (three in flight); a request of
    4 tokens ends in four steps with its outputs in order, and the steps after its last pending
    token compute nothing."""
    core, executor = make_core(tok, True, steps_in_flight=3)
    core.add_request(Request("a", tok.encode("The quick"), SamplingParams(seed=1),
                             StoppingParams(max_tokens=4, ignore_eos=True)))
    assert core.step() == [] and core.step() == []
    assert executor.log == [("submit", 0), ("submit", 1)]
    outs = [core.step() for _ in range(4)]
    assert executor.log[2:5] == [("submit", 2), ("collect", 0), ("submit", 3)]
    assert [len(o) for o in outs] == [1, 1, 1, 1] and outs[-1][0].finished
    assert core.core.num_steps_in_flight == 2   # steps 4 and 5, which compute nothing
    while core.has_unfinished_requests():
        assert core.step() == []
    assert executor.worker.step_tokens[-2:] == [{}, {}]
    assert len(executor.worker.step_tokens) == 6


def test_speculative_decoding_keeps_two_steps_in_flight():
    """Drafts over a step in flight assume one (spec_decode.py): a core asked for three keeps
    two; fewer than two is refused by name."""
    config = SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                             max_model_len=128, async_scheduling=True,
                             speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                                                '"prompt_lookup_max": 3, "prompt_lookup_min": 1}')
    executor = LaggingExecutor(SimWorker(16, 4, sample_fn=sample))
    assert EngineCore(Scheduler(config, 16), executor, steps_in_flight=3).steps_in_flight == 2
    plain = SchedulerConfig(block_size=4, max_num_seqs=4, max_model_len=128,
                            async_scheduling=True)
    assert EngineCore(Scheduler(plain, 16), executor, steps_in_flight=3).steps_in_flight == 3
    with pytest.raises(ValueError, match="steps_in_flight=1 is invalid: must be >= 2"):
        EngineCore(Scheduler(plain, 16), executor, steps_in_flight=1)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_idle_core_sends_the_finished_handles_in_a_step_that_computes_nothing(
        tok, async_scheduling):
    """Once nothing is left to run, has_work stays true while the worker caches a finished
    request; the step() it asks for sends one diff with the finished handle and no work (async:
    submitted, then collected), and the worker caches nothing."""
    engine, executor = make_core(tok, async_scheduling)
    core = engine.core
    engine.add_request(Request("a", tok.encode("The quick"), SamplingParams(seed=1),
                             StoppingParams(max_tokens=3, ignore_eos=True)))
    while engine.has_unfinished_requests():
        engine.step()
    worker = executor.worker
    assert list(worker.reqs) == [0] and core.has_work()
    steps_before = worker.next_step
    while core.has_work():
        assert core.step() == []
    assert worker.next_step == steps_before + 1 and worker.reqs == {}
    last = worker.diffs[-1]
    assert last.finished_handles == [0] and not last.new_requests and worker.step_tokens[-1] == {}
    if async_scheduling:
        assert executor.log[-2:] == [("submit", steps_before), ("collect", steps_before)]
    assert not core.has_unfinished_requests() and not core.scheduler.has_finished_to_send()
