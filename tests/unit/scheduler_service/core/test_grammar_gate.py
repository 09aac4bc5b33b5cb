"""Issue 23 item 4, the scheduler's half: a constrained request samples only once the output rank
reported its grammar compiled (RunnerOutput.compiled_handles). Until then its prompt is
prefilled up to the sampling position and it idles; nobody else waits. SimWorker fails any step
that samples a request whose grammar it has not reported."""
from __future__ import annotations

import random

from engine_common.constraints.constraint import Constraint
from engine_common.wire.diff import RunnerOutput
from tests.support.scheduler_sim import assert_no_leak, make, make_request, run_steps, step

YES_NO = Constraint("choice", ("yes", "no"))


def constrained(rid, prompt, **kw):
    request = make_request(rid, prompt, **kw)
    request.constraint = YES_NO
    return request


def test_a_compiling_request_waits_at_its_last_prompt_token_and_nobody_else_does():
    sched, worker = make()
    worker.compile_steps = None                 # compiles until released
    stream = make_request("stream", [3, 4, 5], max_tokens=40)
    picky = constrained("picky", range(10, 20), max_tokens=3)
    sched.add_request(stream)
    step(sched, worker)
    sched.add_request(picky)
    for i in range(10):
        before = stream.num_output_tokens
        step(sched, worker)
        assert stream.num_output_tokens == before + 1, f"step {i}"
        assert picky.num_output_tokens == 0 and picky.awaiting_grammar
    assert picky.num_computed_tokens == 9       # all but the sampling position
    assert worker.step_tokens[-1] == {stream.handle: 1}   # picky idles
    worker.release_compiles()
    step(sched, worker)                         # the report
    assert not picky.awaiting_grammar
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens.get(picky.handle, 1) == 1 and picky.num_output_tokens == 1
    run_steps(sched, worker)
    assert picky.num_output_tokens == 3 and stream.num_output_tokens == 40
    assert_no_leak(sched)


def test_a_one_token_prompt_is_sent_idle_and_a_compiled_one_is_not_held_long():
    sched, worker = make()
    picky = constrained("picky", [7], max_tokens=2)
    sched.add_request(picky)
    out, _ = step(sched, worker)                # sent with 0 tokens; reported compiled
    assert [n.handle for n in out.new_requests] == [picky.handle]
    assert out.num_scheduled_tokens == {picky.handle: 0}
    assert not picky.awaiting_grammar
    step(sched, worker)
    assert picky.num_output_tokens == 1
    run_steps(sched, worker)
    assert_no_leak(sched)


def test_a_report_from_before_a_recycled_handle_was_sent_is_ignored():
    sched, worker = make()
    worker.compile_steps = None
    first = constrained("first", range(10, 14))
    sched.add_request(first)
    old, _ = step(sched, worker)
    sched.finish_requests("first", first.status.FINISHED_ABORTED)
    step(sched, worker)                         # the workers drop it; its handle is free again
    second = constrained("second", range(20, 24))
    sched.add_request(second)
    assert second.handle == first.handle
    out = sched.schedule()
    # A late report about the old request (a step before the new one was sent) changes nothing.
    sched.update_from_output(old, RunnerOutput(old.step, compiled_handles=[second.handle]))
    assert second.awaiting_grammar
    sched.update_from_output(out, worker.execute(out))
    worker.release_compiles()
    run_steps(sched, worker)
    assert second.num_output_tokens == 8
    assert_no_leak(sched)


def test_a_long_prefill_that_frees_blocks_for_itself_stops_before_its_sampling_position():
    """Random small caches with long prefills (a small threshold) and constrained requests that
    compile for a few steps. A long constrained prefill that finds no free block and preempts
    to grow (nothing else computes that step) took every token left, its sampling position
    included: the worker's step then waited for the compile (SimWorker fails it)."""
    for seed in range(400):
        rng = random.Random(seed)
        num_blocks = rng.randrange(4, 14)
        sched, worker = make(num_blocks=num_blocks, max_num_seqs=rng.randrange(2, 5),
                             max_num_batched_tokens=rng.choice([8, 16]),
                             long_prefill_token_threshold=rng.choice([2, 4]),
                             max_long_partial_prefills=rng.choice([1, 2]))
        worker.compile_steps = rng.choice([2, 5, 10])
        for i in range(rng.randrange(2, 5)):
            prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(1, num_blocks * 4))]
            maker = constrained if rng.random() < 0.7 else make_request
            sched.add_request(maker(f"r{i}", prompt, max_tokens=rng.randrange(1, 4), seed=i,
                                    arrival=float(i), priority=rng.randrange(2)))
        run_steps(sched, worker, max_steps=500)
        assert_no_leak(sched)
