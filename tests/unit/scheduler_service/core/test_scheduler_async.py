"""Async scheduling against SimWorker: the scheduler plans step t+1 before step t's tokens come
back (the worker feeds its own sampled tokens back, as real workers do). Every request must end
with exactly the tokens of a synchronous run, with chunked prefill, prefix hits, preemption
while a step is in flight, stop tokens, max_tokens and late arrivals; nothing may leak, and a
request whose in-flight token is its last is not computed again. A second fuzz adds aborts at
random steps, stop ids masked until min_tokens, and max_len endings, and checks after every step
that the worker holds exactly the scheduler's tokens plus the pending ones."""
from __future__ import annotations

import random
from collections import deque

from engine_common.wire.codec import encode_scheduler_output
from engine_common.request.params import StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from tests.support.scheduler_sim import SimWorker, default_sample, run_steps
from tests.support.scheduler_sim import assert_no_leak, make, make_request

EOS = 2


def eos_sometimes(state) -> int:
    """default_sample, but about one token in 30 is the eos id."""
    token = default_sample(state)
    return EOS if token % 30 == 0 else token


def run_async(sched, worker: SimWorker, on_step=None, stats=None, max_steps: int = 2000):
    """Two steps in flight: schedule and run t+1, then hand step t's output to the scheduler."""
    in_flight, updates = deque(), []
    for _ in range(max_steps):
        if not (sched.has_unfinished_requests() or in_flight):
            break
        if sched.has_unfinished_requests():
            out = sched.schedule()
            if stats is not None:
                by_handle = {r.handle: r for r in sched._requests.values()}
                stats["preempted_in_flight"] += sum(
                    by_handle[h].num_pending_tokens > 0 for h in out.preempted_handles
                    if h in by_handle)
            result = worker.execute(out)
            assert sched.scheduled_tokens(out.step) == worker.step_tokens[-1]
            in_flight.append((out, result))
            if len(in_flight) < 2:
                continue
        out, result = in_flight.popleft()
        step_updates = sched.update_from_output(out, result)
        updates += step_updates
        if on_step is not None:
            on_step(out, step_updates)
    assert not (sched.has_unfinished_requests() or in_flight), "left after max_steps"
    return updates


def outputs(updates) -> dict[str, tuple[list[int], RequestStatus]]:
    return {u.request.request_id: (list(u.request.output_token_ids), u.request.status)
            for u in updates if u.finished}


def workload(rng: random.Random, n: int):
    shared = [rng.randrange(3, 60) for _ in range(8)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 14))]
        prompt = shared + tail if i % 3 == 0 else tail
        reqs.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 14), seed=i,
                                 priority=rng.randrange(2), arrival=float(i)))
    return reqs


def run_with_arrivals(driver, sched, worker, reqs, rng):
    pending = list(reqs)
    sched.add_request(pending.pop(0))

    def arrive(out, _):
        if pending and rng.random() < 0.6:
            sched.add_request(pending.pop(0))
    updates = []
    while pending or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            sched.add_request(pending.pop(0))
        updates += driver(sched, worker, on_step=arrive)
    return updates


def clone(reqs):
    return [make_request(r.request_id, r.prompt_token_ids, max_tokens=r.stopping.max_tokens,
                         seed=r.sampling.seed, priority=r.priority, arrival=r.arrival_time)
            for r in reqs]


def test_async_matches_sync_on_random_workloads():
    stats = {"preempted_in_flight": 0, "preemptions": 0}
    for seed in range(60):
        rng = random.Random(seed)
        cfg = dict(num_blocks=rng.randrange(8, 20), max_num_seqs=rng.randrange(2, 6),
                   max_num_batched_tokens=rng.choice([8, 16, 32]), sample_fn=eos_sometimes)
        reqs = workload(rng, 10)
        sync_sched, sync_worker = make(**cfg)
        want = outputs(run_with_arrivals(run_steps, sync_sched, sync_worker, clone(reqs),
                                         random.Random(seed)))
        sched, worker = make(**cfg)
        mine = clone(reqs)
        got = outputs(run_with_arrivals(
            lambda s, w, on_step: run_async(s, w, on_step, stats), sched, worker, mine,
            random.Random(seed)))
        assert got == want, f"seed {seed}"
        assert_no_leak(sched)
        worker.execute(sched.schedule())      # the last finished handles reach the worker
        assert worker.reqs == {}
        assert all(r.num_pending_tokens == 0 for r in mine)
        stats["preemptions"] += sum(r.num_preemptions for r in mine)
    assert stats["preemptions"] > 0 and stats["preempted_in_flight"] > 0, stats


def test_a_request_is_not_computed_past_its_last_token():
    """max_tokens m: the prompt and m - 1 sampled tokens are computed, never more, although the
    step after the one sampling the last token is planned before that token is known."""
    sched, worker = make(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [make_request(f"m{m}", range(10 * m + 3, 10 * m + 9), max_tokens=m, seed=m,
                         ignore_eos=True) for m in (1, 2, 5)]
    for r in reqs:
        sched.add_request(r)
    got = outputs(run_async(sched, worker))
    for r in reqs:
        computed = sum(step.get(r.handle, 0) for step in worker.step_tokens)
        assert computed == r.num_prompt_tokens + r.stopping.max_tokens - 1, r.request_id
        assert len(got[r.request_id][0]) == r.stopping.max_tokens
    assert_no_leak(sched)


def test_max_model_len_caps_pending_tokens():
    sched, worker = make(num_blocks=64, max_model_len=12, max_num_batched_tokens=16)
    r = make_request("long", range(3, 11), max_tokens=None, seed=1, ignore_eos=True)
    sched.add_request(r)
    got = outputs(run_async(sched, worker))
    assert len(got["long"][0]) == 4 and got["long"][1] == RequestStatus.FINISHED_LENGTH
    assert sum(step.get(r.handle, 0) for step in worker.step_tokens) == 11
    assert_no_leak(sched)


# ---- aborts at random steps, stop tokens and min_tokens -----------------------------------

STOP_ID = 7


class MaskingSimWorker(SimWorker):
    """SimWorker whose sampler masks stop ids until min_tokens outputs, as the real one does.
    About one token in seven is eos or STOP_ID."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size, sample_fn=self._sample)
        self.min_tokens: dict[int, int] = {}
        self.num_masked = 0

    def _apply(self, out) -> None:
        super()._apply(out)
        for new in out.new_requests:
            self.min_tokens[new.handle] = new.sampling.min_tokens

    def _sample(self, state) -> int:
        token = default_sample(state)
        if token % 7 == 0:
            token = EOS if token % 2 else STOP_ID
        if token in state.stop_ids and len(state.outputs) < self.min_tokens[state.handle]:
            token += 100      # masked: never a stop id
            self.num_masked += 1
        return token


def check_pending(sched, worker: SimWorker) -> None:
    """Each live request's tokens on the worker: the scheduler's, then exactly its pending ones."""
    for r in sched._requests.values():
        if r.handle in sched._on_worker:
            tokens = worker.reqs[r.handle].tokens
            assert tokens[:r.num_tokens] == r.all_token_ids, r.request_id
            assert len(tokens) == r.num_tokens + r.num_pending_tokens, r.request_id


def stop_workload(rng: random.Random, n: int) -> list[Request]:
    reqs = []
    for r in workload(rng, n):
        max_tokens = rng.randrange(1, 16) if rng.random() < 0.8 else None   # None: max_len
        reqs.append(Request(r.request_id, r.prompt_token_ids, r.sampling, StoppingParams(
            max_tokens=max_tokens, min_tokens=rng.randrange(min(4, (max_tokens or 3) + 1)),
            stop_token_ids=(STOP_ID,) if rng.random() < 0.5 else (),
            ignore_eos=rng.random() < 0.2), eos_token_ids=(EOS,), priority=r.priority,
            arrival_time=r.arrival_time))
    return reqs


def copies(reqs: list[Request]) -> list[Request]:
    return [Request(r.request_id, list(r.prompt_token_ids), r.sampling, r.stopping,
                    r.eos_token_ids, priority=r.priority, arrival_time=r.arrival_time)
            for r in reqs]


def run_fuzz(driver, cfg: dict, reqs: list[Request], seed: int, abort_p: float = 0.0,
             stats: dict | None = None):
    """Requests arrive (and, with probability abort_p per step, a live one is aborted) between
    steps, as the engine thread does it. Returns request id -> (tokens, status), and the aborted
    ids, after checking that nothing leaked and the worker dropped every request."""
    sched, _ = make(**cfg)
    worker = MaskingSimWorker(cfg["num_blocks"], sched.config.block_size)
    rng, waiting, aborted = random.Random(seed), list(reqs), []

    def between(out, _):
        check_pending(sched, worker)
        if waiting and rng.random() < 0.6:
            sched.add_request(waiting.pop(0))
        if sched._requests and rng.random() < abort_p:
            rid = rng.choice(sorted(sched._requests))
            if stats is not None:
                stats["aborted_with_pending"] += sched._requests[rid].num_pending_tokens > 0
            assert sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            aborted.append(rid)
    while waiting or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            sched.add_request(waiting.pop(0))
        driver(sched, worker, on_step=between)
    assert_no_leak(sched)
    assert not sched._in_flight and all(r.num_pending_tokens == 0 for r in reqs)
    worker.execute(sched.schedule())      # the last finished handles reach the worker
    assert worker.reqs == {} and worker.batch == [] and sched._handles.num_in_use == 0
    if stats is not None:
        stats["masked"] += worker.num_masked
    return {r.request_id: (r.output_token_ids, r.status) for r in reqs}, aborted


def test_async_with_aborts_stop_tokens_and_min_tokens_matches_sync():
    """Every request not aborted ends exactly as in a synchronous run without aborts; an aborted
    one got a prefix of those tokens. Stop ids sampled before min_tokens are masked."""
    seen = {"aborted_with_pending": 0, "stop_token": 0, "masked": 0, "aborted": 0,
            "max_len": 0}
    for seed in range(40):
        rng = random.Random(seed)
        cfg = dict(num_blocks=rng.randrange(8, 20), max_num_seqs=rng.randrange(2, 6),
                   max_num_batched_tokens=rng.choice([8, 16, 32]))
        reqs = stop_workload(rng, 10)
        want, _ = run_fuzz(run_steps, cfg, copies(reqs), seed, stats=seen)
        for abort_p in (0.0, 0.3):
            mine = copies(reqs)
            got, aborted = run_fuzz(run_async, cfg, mine, seed, abort_p, seen)
            seen["aborted"] += len(aborted)
            for rid, (tokens, status) in got.items():
                if rid in aborted:
                    assert status == RequestStatus.FINISHED_ABORTED, (seed, rid)
                    assert tokens == want[rid][0][:len(tokens)], (seed, rid)
                else:
                    assert (tokens, status) == want[rid], (seed, rid, abort_p)
        seen["stop_token"] += sum(s == RequestStatus.FINISHED_STOP_TOKEN for _, s in want.values())
        seen["max_len"] += sum(r.stopping.max_tokens is None and want[r.request_id][1]
                               == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert seen["stop_token"] > 20 and seen["masked"] > 10, seen
    assert seen["aborted"] > 40 and seen["aborted_with_pending"] > 10 and seen["max_len"] > 3, seen


def test_async_steady_state_diff_is_as_small_as_sync():
    """256 requests decoding with a step in flight: the diff names nothing (8 bytes, as in the
    synchronous engine), although every request's token is still pending when it is built."""
    n = 256
    sched, worker = make(num_blocks=n, block_size=16, max_num_seqs=n,
                         max_num_batched_tokens=2048, max_model_len=64)
    for i in range(n):
        sched.add_request(make_request(f"r{i}", [i % 97 + 3, 5, 6, 7], max_tokens=8,
                                       ignore_eos=True))
    in_flight = deque()
    for i in range(5):
        out = sched.schedule()
        in_flight.append((out, worker.execute(out)))
        if i >= 2:
            assert len(encode_scheduler_output(out)) == 8
            assert worker.step_tokens[-1] == {h: 1 for h in range(n)}
            assert all(r.num_pending_tokens == 2 for r in sched._requests.values())
        if len(in_flight) == 2:
            assert not any(u.finished for u in sched.update_from_output(*in_flight.popleft()))
