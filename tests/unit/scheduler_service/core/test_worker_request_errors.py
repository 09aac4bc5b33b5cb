"""A request that failed on the output rank (RunnerOutput.request_errors: its grammar) is aborted
alone with the worker's message: its token of that step is dropped, its blocks go back, the
workers are told to drop it, and the other requests of the batch go on as if nothing happened."""
from __future__ import annotations

from engine_common.constraints.constraint import Constraint
from scheduler_service.core.request import RequestStatus
from tests.support.scheduler_sim import assert_no_leak, make, make_request, run_steps, step

DIGITS = Constraint("regex", "[0-9]+")


def _fail_next(worker, handle: int, why: str) -> None:
    """The worker's next reply reports `handle` failed."""
    run = worker._run

    def failing(out):
        worker._run = run
        result = run(out)
        result.request_errors = {handle: why}
        return result
    worker._run = failing


def test_a_request_that_failed_on_the_worker_is_aborted_alone_with_the_message():
    sched, worker = make()
    picky = make_request("picky", [3, 4, 5], max_tokens=20)
    picky.constraint = DIGITS
    others = [make_request(f"o{i}", [6, 7, 8 + i], max_tokens=6) for i in range(3)]
    for request in (picky, *others):
        sched.add_request(request)
    for _ in range(3):
        step(sched, worker)
    assert picky.num_output_tokens == 2 and picky.status == RequestStatus.RUNNING
    held = sched.num_free_blocks
    _fail_next(worker, picky.handle, "its grammar failed: lexer error")
    out, updates = step(sched, worker)
    (final,) = [u for u in updates if u.request_id == "picky"]
    assert final.finish_reason == RequestStatus.FINISHED_ABORTED and final.new_token_ids == []
    assert final.error == "request 'picky' failed on the worker: its grammar failed: lexer error"
    assert picky.num_output_tokens == 2            # the failed step's token is dropped
    assert sched.num_free_blocks > held            # its blocks are back at once
    assert {u.request_id for u in updates} == {"picky", "o0", "o1", "o2"}
    assert all(u.error is None and len(u.new_token_ids) == 1 for u in updates if u is not final)
    out, _ = step(sched, worker)
    assert out.finished_handles == [picky.handle]  # the workers drop it
    run_steps(sched, worker)
    assert all(r.num_output_tokens == 6 and r.status == RequestStatus.FINISHED_LENGTH
               for r in others)
    assert_no_leak(sched)


def test_an_error_for_a_request_finished_since_or_not_in_the_step_is_ignored():
    sched, worker = make()
    a = make_request("a", [3, 4], max_tokens=4)
    sched.add_request(a)
    step(sched, worker)
    out = sched.schedule()
    reply = worker.execute(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    reply.request_errors = {a.handle: "late", 99: "not in the step"}
    assert sched.update_from_output(out, reply) == []
    assert a.error is None
    step(sched, worker)
    assert_no_leak(sched)
