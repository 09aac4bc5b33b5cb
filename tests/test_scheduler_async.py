"""Async scheduling against SimWorker: the scheduler plans step t+1 before step t's tokens come
back (the worker feeds its own sampled tokens back, as real workers do). Every request must end
with exactly the tokens of a synchronous run, with chunked prefill, prefix hits, preemption
while a step is in flight, stop tokens, max_tokens and late arrivals; nothing may leak, and a
request whose in-flight token is its last is not computed again."""
from __future__ import annotations

import random
from collections import deque

from scheduler_service.request import RequestStatus
from tests.scheduler_sim import SimWorker, default_sample, run_steps
from tests.test_scheduler import assert_no_leak, make, make_request

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
