"""Fairness under a steady stream of short requests: a long-running decode in a tiny cache is
never the one preempted (memory preemption takes the latest arrival), and a huge prompt keeps
its long-prefill share of every step, so it finishes in bounded steps while the short requests
around it still finish within a few steps of their arrival."""
from __future__ import annotations

from tests.support.scheduler_sim import assert_no_leak, make, make_request, step


def stream(sched, worker, first, make_short, num_arrivals: int, max_steps: int = 1000):
    """Add `first`, then one short request per step for num_arrivals steps; run to the end.
    Returns (shorts, arrival step by id, finish step by id)."""
    sched.add_request(first)
    shorts, arrived, finished = [], {}, {}
    for i in range(max_steps):
        if i < num_arrivals:
            short = make_short(i)
            sched.add_request(short)
            shorts.append(short)
            arrived[short.request_id] = i
        if not sched.has_unfinished_requests():
            break
        _, updates = step(sched, worker)
        finished.update((u.request_id, i) for u in updates if u.finished)
    assert not sched.has_unfinished_requests()
    return shorts, arrived, finished


def test_a_long_decode_is_never_preempted_by_the_requests_after_it():
    # 8 blocks of 4: the long request ends holding 8 of them; the short ones come and go.
    sched, worker = make(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=16,
                         max_model_len=32)
    first = make_request("long", [5, 6, 7, 8], max_tokens=27, seed=1, arrival=0.0,
                         ignore_eos=True)
    shorts, _, finished = stream(
        sched, worker, first,
        lambda i: make_request(f"s{i}", [9 + i % 50, 10, 11], max_tokens=4, seed=i,
                               arrival=1.0 + i, ignore_eos=True), num_arrivals=120)
    assert first.num_preemptions == 0 and first.num_output_tokens == 27
    assert sum(s.num_preemptions for s in shorts) > 0, "the cache was sized to preempt"
    assert max(s.num_preemptions for s in shorts) <= 3
    assert len(finished) == 121
    assert_no_leak(sched)


def test_a_huge_prompt_and_a_stream_of_short_ones_both_progress():
    sched, worker = make(num_blocks=200, max_num_seqs=16, max_num_batched_tokens=16,
                         max_model_len=256, long_prefill_token_threshold=8)
    huge = make_request("huge", [5 + i % 40 for i in range(240)], max_tokens=4, seed=1,
                        arrival=0.0, ignore_eos=True)
    shorts, arrived, finished = stream(
        sched, worker, huge,
        lambda i: make_request(f"s{i}", [9 + i % 50] + [10] * 7, max_tokens=3, seed=i,
                               arrival=1.0 + i, ignore_eos=True), num_arrivals=300)
    # 240 tokens at >= 8 a step (the threshold) while others run: about 30 steps, not 300.
    assert finished["huge"] <= 40
    assert max(finished[s.request_id] - arrived[s.request_id] for s in shorts) <= 12
    assert_no_leak(sched)
