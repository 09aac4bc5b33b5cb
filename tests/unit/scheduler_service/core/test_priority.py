"""Priority scheduling against SimWorker: a more urgent waiting request preempts less urgent
running ones when (and only when) that makes room; equal priorities never preempt each other;
a running request only ever preempts less urgent ones; tokens equal an unpreempted run."""
from __future__ import annotations

import random

from scheduler_service.core.request import RequestStatus
from scheduler_service.core.waiting_queue import WaitingQueue
from tests.support.scheduler_sim import run_steps
from tests.support.scheduler_sim import assert_no_leak, make, make_request, step


def finished_tokens(updates) -> dict[str, list[int]]:
    return {u.request.request_id: list(u.request.output_token_ids) for u in updates if u.finished}


def reference(requests) -> dict[str, list[int]]:
    sched, worker = make(num_blocks=256, max_num_seqs=16)
    for r in requests:
        sched.add_request(make_request(r.request_id, r.prompt_token_ids,
                                       max_tokens=r.stopping.max_tokens, seed=r.sampling.seed,
                                       priority=r.priority))
    return finished_tokens(run_steps(sched, worker))


def test_urgent_request_takes_a_seat_from_the_latest_less_urgent_one():
    sched, worker = make(max_num_seqs=2)
    low = [make_request(f"low{i}", range(10 + i, 16 + i), max_tokens=12, seed=i, priority=1,
                        arrival=float(i)) for i in range(2)]
    for r in low:
        sched.add_request(r)
    step(sched, worker)
    urgent = make_request("urgent", range(50, 55), max_tokens=4, seed=9, priority=0, arrival=5.0)
    sched.add_request(urgent)
    out, _ = step(sched, worker)
    # The latest-arriving low-priority request gives up its seat; urgent starts this very step.
    assert out.preempted_handles == [low[1].handle]
    assert [r.handle for r in out.new_requests] == [urgent.handle]
    updates = run_steps(sched, worker)
    assert low[1].num_preemptions == 1 and low[0].num_preemptions == 0
    done = [u.request.request_id for u in updates if u.finished]
    assert done.index("urgent") < done.index("low1")
    got = {**finished_tokens(updates)}
    assert got == reference(low + [urgent])
    assert_no_leak(sched)


def test_urgent_request_frees_blocks_least_urgent_first():
    # 4-token blocks; 3 running requests of priorities 1, 2, 2 hold 3 blocks each (12 tokens).
    sched, worker = make(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=64)
    running = [make_request(f"r{i}", range(20 * i + 1, 20 * i + 11), max_tokens=20, seed=i,
                            priority=p, arrival=float(i)) for i, p in enumerate((1, 2, 2))]
    for r in running:
        sched.add_request(r)
    step(sched, worker)
    step(sched, worker)
    urgent = make_request("urgent", range(90, 102), max_tokens=3, seed=7, priority=0, arrival=9.0)
    sched.add_request(urgent)          # 12 prompt tokens: 4 blocks with room for its first token
    out, _ = step(sched, worker)
    # r2 (priority 2, latest) goes first; one victim frees 3 blocks, and 1 was free: enough.
    assert out.preempted_handles == [running[2].handle]
    assert [r.handle for r in out.new_requests] == [urgent.handle]
    updates = run_steps(sched, worker)
    assert finished_tokens(updates) == {k: v for k, v in reference(running + [urgent]).items()
                                        if k in finished_tokens(updates)}
    assert_no_leak(sched)


def test_equal_priority_never_preempts():
    sched, worker = make(max_num_seqs=2)
    reqs = [make_request(f"r{i}", range(10 + i, 16 + i), max_tokens=6, seed=i, arrival=float(i))
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_steps(sched, worker)
    assert all(r.num_preemptions == 0 for r in reqs)
    assert not any(d.preempted_handles for d in worker.diffs)
    assert_no_leak(sched)


def test_no_preemption_when_victims_cannot_make_room():
    # The only less urgent request holds 2 blocks; urgent needs 5 and 1 is free.
    sched, worker = make(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=64)
    big = make_request("big", range(1, 19), max_tokens=2, seed=1, priority=0, arrival=0.0)
    small = make_request("small", range(30, 37), max_tokens=2, seed=2, priority=5, arrival=1.0)
    sched.add_request(big)
    sched.add_request(small)
    step(sched, worker)                # big: 5 blocks, small: 2 blocks, 1 free
    urgent = make_request("urgent", range(60, 78), max_tokens=2, seed=3, priority=1, arrival=2.0)
    sched.add_request(urgent)
    out, _ = step(sched, worker)
    assert not out.preempted_handles and not out.new_requests
    updates = run_steps(sched, worker)
    assert small.num_preemptions == 0 and "urgent" in finished_tokens(updates)
    assert_no_leak(sched)


def test_urgent_running_request_preempts_less_urgent_ones_admitted_before_it():
    # Urgent is admitted after two less urgent requests, then all three grow until blocks run
    # out: the urgent one is scheduled first and only ever preempts the others.
    sched, worker = make(num_blocks=9, max_num_seqs=8, max_num_batched_tokens=64)
    low = [make_request(f"low{i}", range(10 * i + 1, 10 * i + 5), max_tokens=16, seed=i,
                        priority=3, arrival=float(i)) for i in range(2)]
    for r in low:
        sched.add_request(r)
    step(sched, worker)
    urgent = make_request("urgent", range(70, 74), max_tokens=16, seed=5, priority=0,
                          arrival=9.0)
    sched.add_request(urgent)
    updates = run_steps(sched, worker)
    assert urgent.num_preemptions == 0
    assert sum(r.num_preemptions for r in low) >= 1
    assert finished_tokens(updates) == reference(low + [urgent])
    assert_no_leak(sched)


def test_waiting_order_is_priority_then_preempted_then_arrival():
    queue = WaitingQueue()
    fresh_urgent = make_request("fresh_urgent", [1, 2], priority=0, arrival=5.0)
    preempted_low = make_request("preempted_low", [3, 4], priority=1, arrival=0.0)
    preempted_low.status = RequestStatus.PREEMPTED
    fresh_low_early = make_request("fresh_low_early", [5], priority=1, arrival=-1.0)
    for r in (preempted_low, fresh_low_early, fresh_urgent):
        queue.push(r)
    assert [r.request_id for r in queue] == ["fresh_urgent", "preempted_low", "fresh_low_early"]


def test_random_priority_workloads_match_unpreempted_runs():
    """Many seeds: random priorities, arrivals spread over the run, a tight cache. Every request
    finishes with the tokens it gets alone, nothing leaks, and at least some seeds preempt."""
    total_preemptions = 0
    for seed in range(40):
        rng = random.Random(seed)
        sched, worker = make(num_blocks=rng.randrange(8, 16), max_num_seqs=rng.randrange(2, 6),
                             max_num_batched_tokens=16)
        pending = [make_request(f"s{seed}r{i}", [rng.randrange(3, 60)
                                                 for _ in range(rng.randrange(1, 12))],
                                max_tokens=rng.randrange(1, 12), seed=i,
                                priority=rng.randrange(3), arrival=float(i))
                   for i in range(10)]
        requests = list(pending)
        sched.add_request(pending.pop(0))

        def arrive(out, _):
            if pending and rng.random() < 0.5:
                sched.add_request(pending.pop(0))
        updates = []
        while pending or sched.has_unfinished_requests():
            if not sched.has_unfinished_requests():
                sched.add_request(pending.pop(0))
            updates += run_steps(sched, worker, on_step=arrive)
        assert finished_tokens(updates) == reference(requests), f"seed {seed}"
        assert_no_leak(sched)
        total_preemptions += sum(r.num_preemptions for r in requests)
    assert total_preemptions > 0

def _urgent_long_behind_a_long_prefill():
    """(sched, worker, first_long, decode, second_long): a priority-0 long prefill running beside
    a priority-5 decode (2 seats, long-prefill threshold 8, limit 1), after one step, and a second
    priority-0 long prompt not added yet."""
    sched, worker = make(num_blocks=256, max_num_seqs=2, max_num_batched_tokens=32,
                         long_prefill_token_threshold=8, max_model_len=400)
    first_long = make_request("long1", range(3, 203), max_tokens=4, seed=1, priority=0,
                              arrival=1.0)
    decode = make_request("decode", range(300, 306), max_tokens=30, seed=2, priority=5,
                          arrival=2.0, ignore_eos=True)
    sched.add_request(first_long)
    sched.add_request(decode)
    step(sched, worker)
    second_long = make_request("long2", range(400, 500), max_tokens=4, seed=3, priority=0,
                               arrival=3.0)
    return sched, worker, first_long, decode, second_long


def test_no_preemption_for_a_long_head_the_long_prefill_limit_holds_back():
    """An urgent long prompt waiting behind an equally urgent long prefill (limit 1) cannot be
    admitted whatever is preempted: the less urgent decode keeps its seat while the long prefill
    lasts, instead of being preempted (and recomputed) every step, then readmitted past the long
    head. Once the long prefill is short, the long head takes the decode's seat."""
    sched, worker, first_long, decode, second_long = _urgent_long_behind_a_long_prefill()
    sched.add_request(second_long)
    steps = 0
    while first_long.num_tokens - first_long.num_computed_tokens > 8:    # still a long prefill
        steps += 1
        before = decode.num_output_tokens
        out, _ = step(sched, worker)
        assert not out.preempted_handles, f"step {out.step}: {out.preempted_handles}"
        assert decode.num_output_tokens == before + 1      # a token every step, no recompute
    assert steps >= 5
    updates = run_steps(sched, worker)
    alone, alone_worker = make(num_blocks=256, max_num_seqs=4, max_model_len=400)
    for r in (first_long, decode, second_long):
        alone.add_request(make_request(r.request_id, r.prompt_token_ids,
                                       max_tokens=r.stopping.max_tokens, seed=r.sampling.seed,
                                       ignore_eos=r.stopping.ignore_eos))
    want = finished_tokens(run_steps(alone, alone_worker))
    assert {**finished_tokens(updates), "long1": first_long.output_token_ids} == want
    assert second_long.status == RequestStatus.FINISHED_LENGTH
    assert_no_leak(sched)


def test_no_preemption_for_nothing_when_the_victim_holds_the_heads_prefix_hits():
    """A victim's blocks that the urgent head hits in the prefix cache go back to the free queue
    and straight out again as the head is admitted: they make no room. With them counted, the
    victim was preempted and the head still did not fit."""
    # 4-token blocks, 8 of them. The victim and the head share a 2-block prefix that only the
    # victim holds; the head needs 4 blocks more, 2 are free and the victim holds 3.
    sched, worker = make(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=64)
    prefix = list(range(3, 11))
    victim = make_request("victim", prefix + [40, 41, 42], max_tokens=3, seed=1, priority=5,
                          arrival=0.0)
    urgent_running = make_request("running", range(50, 60), max_tokens=3, seed=2, priority=0,
                                  arrival=0.5)
    sched.add_request(victim)
    sched.add_request(urgent_running)
    step(sched, worker)
    assert sched.num_free_blocks == 2
    head = make_request("head", prefix + list(range(70, 86)), max_tokens=2, seed=3, priority=0,
                        arrival=1.0)
    sched.add_request(head)
    out, _ = step(sched, worker)
    assert not out.preempted_handles and not out.new_requests
    updates = run_steps(sched, worker)
    assert all(r.num_preemptions == 0 for r in (victim, urgent_running, head))
    assert finished_tokens(updates) == {k: v for k, v in reference(
        [victim, urgent_running, head]).items() if k in finished_tokens(updates)}
    assert len(finished_tokens(updates)) == 3
    assert_no_leak(sched)


def test_a_victim_is_still_preempted_when_its_blocks_beside_the_hits_make_room():
    """The same shapes with a head one block smaller: the victim's one block beside the shared
    prefix and the 2 free ones hold the head's 3 new blocks, so the victim makes way."""
    sched, worker = make(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=64)
    prefix = list(range(3, 11))
    victim = make_request("victim", prefix + [40, 41, 42], max_tokens=3, seed=1, priority=5,
                          arrival=0.0)
    sched.add_request(victim)
    sched.add_request(make_request("running", range(50, 60), max_tokens=3, seed=2, priority=0,
                                   arrival=0.5))
    step(sched, worker)
    head = make_request("head", prefix + list(range(70, 82)), max_tokens=2, seed=3, priority=0,
                        arrival=1.0)
    sched.add_request(head)
    out, _ = step(sched, worker)
    assert out.preempted_handles == [victim.handle]
    assert [r.handle for r in out.new_requests] == [head.handle]
    run_steps(sched, worker)
    assert_no_leak(sched)


def test_an_urgent_long_prompt_preempts_only_for_its_first_chunk():
    """A long prompt is admitted beside others with at most long_prefill_token_threshold tokens:
    priority preemption makes room for that chunk, not for a whole step's budget (before, three
    less urgent decodes were preempted for an 8-token chunk that the 2 free blocks held)."""
    sched, worker = make(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=32,
                         long_prefill_token_threshold=8, max_model_len=200)
    decodes = [make_request(f"d{i}", range(3 + 10 * i, 9 + 10 * i), max_tokens=40, seed=i,
                            priority=5, arrival=float(i), ignore_eos=True) for i in range(4)]
    for r in decodes:
        sched.add_request(r)
    step(sched, worker)                # 6 tokens each in 2 blocks: room for 2 more
    assert sched.num_free_blocks == 2
    urgent = make_request("urgent", range(150, 186), max_tokens=2, seed=9, priority=0,
                          arrival=10.0)
    sched.add_request(urgent)          # 36 tokens: a long prompt, 8 of them this step
    out, _ = step(sched, worker)
    assert not out.preempted_handles
    assert [r.handle for r in out.new_requests] == [urgent.handle]
    assert urgent.num_computed_tokens == 8
    updates = run_steps(sched, worker)
    assert "urgent" in finished_tokens(updates)
    assert_no_leak(sched)


def test_a_victim_is_kept_when_the_long_prefills_left_after_it_still_hold_the_head_back():
    """Two long prefills in progress (the limit), one more urgent and one less urgent than a
    long head: preempting the latest less urgent request (a decode) would leave both, so the
    head stays held back and the decode keeps its seat; the head takes it once the urgent long
    prefill is short."""
    sched, worker = make(num_blocks=256, max_num_seqs=3, max_num_batched_tokens=32,
                         long_prefill_token_threshold=8, max_long_partial_prefills=2,
                         max_model_len=400)
    urgent_long = make_request("long0", range(3, 203), max_tokens=4, seed=1, priority=0,
                               arrival=1.0)
    lazy_long = make_request("long9", range(203, 403), max_tokens=4, seed=4, priority=9,
                             arrival=1.5)
    decode = make_request("decode", range(300, 306), max_tokens=30, seed=2, priority=9,
                          arrival=2.0, ignore_eos=True)
    for r in (urgent_long, lazy_long, decode):
        sched.add_request(r)
    step(sched, worker)
    head = make_request("head", range(400, 500), max_tokens=4, seed=3, priority=5, arrival=3.0)
    sched.add_request(head)
    steps = 0
    while urgent_long.num_tokens - urgent_long.num_computed_tokens > 8:
        steps += 1
        before = decode.num_output_tokens
        out, _ = step(sched, worker)
        assert not out.preempted_handles, f"step {out.step}: {out.preempted_handles}"
        assert decode.num_output_tokens == before + 1
    assert steps >= 5
    out, _ = step(sched, worker)
    assert out.preempted_handles == [decode.handle] and head.status == RequestStatus.RUNNING
    run_steps(sched, worker)
    assert_no_leak(sched)


def test_an_urgent_short_request_behind_a_held_back_long_head_takes_a_less_urgent_seat():
    """Admission passes a long head the long-prefill limit holds back; so does priority
    preemption: the urgent short request behind it preempts the less urgent decode and starts
    at once, as it would at the head of the queue."""
    sched, worker, first_long, decode, second_long = _urgent_long_behind_a_long_prefill()
    short = make_request("short", range(500, 505), max_tokens=4, seed=4, priority=0, arrival=4.0)
    sched.add_request(second_long)
    sched.add_request(short)
    out, _ = step(sched, worker)
    assert out.preempted_handles == [decode.handle]
    assert [r.handle for r in out.new_requests] == [short.handle] and not out.resumed_requests
    run_steps(sched, worker)
    assert_no_leak(sched)
