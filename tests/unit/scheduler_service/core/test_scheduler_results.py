"""A step's results in the scheduler, driven end to end against SimWorker
(tests/scheduler_sim.py): stop rules and length limits, aborts wherever a request is, handles
recycled only after the workers heard of the finish, and the TokenUpdates handed on (logprobs,
held updates, the finish facts the output processor reads). Scheduler.update_from_output applies
them (scheduler_service/core/sampled_tokens.py)."""
from __future__ import annotations

import pytest

from engine_common.constraints.constraint import Constraint
from engine_common.wire.diff import RunnerOutput
from scheduler_service.core.admission import RequestRejected
from scheduler_service.core.reply_checks import BadReply
from scheduler_service.core.request import RequestStatus
from scheduler_service.core.step_result import TokenUpdate
from tests.support.scheduler_sim import run_steps
from tests.unit.scheduler_service.core.test_scheduler_async import run_async
from tests.support.scheduler_sim import assert_no_leak, make, make_request, step


def scripted(script):
    """Sample the seed's scripted tokens in order (then 100, 101, ...)."""
    def sample(state):
        seq = script.get(state.seed, [])
        k = len(state.outputs)
        return seq[k] if k < len(seq) else 100 + k
    return sample


@pytest.mark.parametrize("stopping, script, want_status, want_out", [
    ({}, [50, 2, 51], RequestStatus.FINISHED_STOP_TOKEN, [50, 2]),                 # eos
    ({"stop_token_ids": (9,)}, [50, 9, 51], RequestStatus.FINISHED_STOP_TOKEN, [50, 9]),
    ({"ignore_eos": True}, [2, 2, 2], RequestStatus.FINISHED_LENGTH, [2, 2, 2]),
    ({"min_tokens": 2}, [2, 2, 2, 2], RequestStatus.FINISHED_STOP_TOKEN, [2, 2, 2]),
    ({}, [50, 51, 52, 53], RequestStatus.FINISHED_LENGTH, [50, 51, 52]),           # max_tokens
])
def test_stop_rules(stopping, script, want_status, want_out):
    sched, worker = make(sample_fn=scripted({7: script}))
    req = make_request("r", [5, 6, 7], max_tokens=3, seed=7, **stopping)
    sched.add_request(req)
    updates = run_steps(sched, worker)
    assert req.status == want_status and req.output_token_ids == want_out
    assert [u.finished for u in updates] == [False] * (len(want_out) - 1) + [True]
    if want_status == RequestStatus.FINISHED_STOP_TOKEN:
        assert req.stop_reason == want_out[-1]
    step(sched, worker)
    assert_no_leak(sched)


def test_a_constrained_request_stops_on_eos_even_before_min_tokens():
    """A complete grammar allows only eos (the worker then drops the min_tokens mask): the
    grammar wins, the request ends there."""
    sched, worker = make(sample_fn=scripted({7: [50, 2, 51, 52]}))
    req = make_request("r", [5, 6, 7], max_tokens=4, seed=7, min_tokens=3)
    req.constraint = Constraint("choice", ("ab",))
    sched.add_request(req)
    run_steps(sched, worker)
    assert req.status == RequestStatus.FINISHED_STOP_TOKEN and req.output_token_ids == [50, 2]
    step(sched, worker)
    assert_no_leak(sched)


def test_max_model_len_and_unbounded_max_tokens():
    sched, worker = make(max_model_len=16)
    req = make_request("r", range(3, 13), max_tokens=None)
    sched.add_request(req)
    run_steps(sched, worker)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 16


def test_abort_waiting_running_preempted_frees_blocks_and_handles():
    sched, worker = make(num_blocks=7, max_num_seqs=2)
    reqs = [make_request(f"r{i}", range(10 * i + 3, 10 * i + 11), max_tokens=12, seed=i)
            for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    # Run until r1 has been preempted (r2 has never been admitted: max_num_seqs=2).
    for _ in range(30):
        step(sched, worker)
        if reqs[1].status == RequestStatus.PREEMPTED:
            break
    assert reqs[1].status == RequestStatus.PREEMPTED and reqs[2].status == RequestStatus.WAITING
    assert reqs[1].num_computed_tokens == 0 and sched.kv.get_block_ids(reqs[1]) == []
    assert sched.num_free_blocks < sched.num_total_blocks
    done = sched.finish_requests(["r0", "r1", "r2"], RequestStatus.FINISHED_ABORTED)
    assert len(done) == 3
    assert sched.finish_requests(["r0", "r1"], RequestStatus.FINISHED_ABORTED) == []
    assert_no_leak(sched)
    assert not sched.has_unfinished_requests() and sched.has_finished_to_send()
    # r2 was never sent, so its handle is free already; r0 and r1 are told to the workers first.
    again = make_request("again", [1, 3, 4])
    sched.add_request(again)
    assert again.handle == reqs[2].handle
    out, _ = step(sched, worker)
    assert sorted(out.finished_handles) == sorted([reqs[0].handle, reqs[1].handle])
    assert [r.handle for r in out.new_requests] == [again.handle]
    assert not worker.reqs.keys() - {again.handle}
    sched.finish_requests("again", RequestStatus.FINISHED_ABORTED)
    step(sched, worker)
    assert_no_leak(sched)


def test_handles_recycled_only_after_finished_is_sent():
    sched, worker = make()
    a, b = make_request("a", [3, 4]), make_request("b", [5, 6])
    sched.add_request(a)
    sched.add_request(b)
    step(sched, worker)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOP_STRING)
    c = make_request("c", [7, 8])
    sched.add_request(c)
    assert c.handle not in (a.handle, b.handle)
    out, _ = step(sched, worker)
    assert out.finished_handles == [a.handle]
    d = make_request("d", [9, 10])
    sched.add_request(d)
    assert d.handle == a.handle
    sched.finish_requests(["b", "c", "d"], RequestStatus.FINISHED_ABORTED)
    step(sched, worker)
    assert_no_leak(sched)


def test_outputs_of_aborted_requests_are_ignored():
    sched, worker = make()
    a, b = make_request("a", [3, 4]), make_request("b", [5, 6])
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    runner_out = worker.execute(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    updates = sched.update_from_output(out, runner_out)
    assert [u.request.request_id for u in updates] == ["b"]
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    # A token for a step that has no request in flight (this one was applied) is a bad reply
    # (reply_checks.py), never appended to anything.
    with pytest.raises(BadReply, match=r"handles=\d+ must be one of the 0 handles"):
        sched.update_from_output(out, RunnerOutput(out.step, [b.handle], [5], [0.0]))
    sampled = dict(zip(runner_out.handles, runner_out.sampled_token_ids))
    assert b.output_token_ids == [sampled[b.handle]]


def test_logprobs_and_updates():
    sched, worker = make()
    req = make_request("r", [3, 4, 5], max_tokens=2)
    req.num_logprobs = 2
    sched.add_request(req)
    updates = run_steps(sched, worker)
    assert worker.diffs[0].new_requests[0].num_logprobs == 2
    assert [u.new_logprobs for u in updates] == [[-0.5], [-0.5]]
    assert updates[0].top_logprobs == [([0, 1], [-1.0, -1.0])]
    assert req.first_token_time is not None and req.finish_time is not None


def test_held_updates_come_once_with_every_token():
    """A request whose owner reads only its final update (held_logprobs set) gets no update
    per step; its final one carries every output token and logprob, through a preemption;
    a held request aborted mid-way gets its tokens so far (with no logprobs sent: none)."""
    sched, worker = make(num_blocks=5)
    held, other = make_request("held", [3, 4, 5], max_tokens=9), make_request("o", [6, 7])
    held.held_logprobs = []
    for r in (held, other):
        sched.add_request(r)
    updates = run_steps(sched, worker)
    assert held.num_preemptions or other.num_preemptions     # 5 blocks of 4 hold not both
    mine = [u for u in updates if u.request_id == "held"]
    assert len(mine) == 1 and mine[0].finished
    assert mine[0].new_token_ids == held.output_token_ids and len(held.output_token_ids) == 9
    assert mine[0].new_logprobs == [-0.5] * 9
    assert len([u for u in updates if u.request_id == "o"]) == other.num_output_tokens

    sched, worker = make()
    aborted = make_request("a", [3, 4], max_tokens=20)
    aborted.held_logprobs = []
    sched.add_request(aborted)
    for _ in range(3):
        out = sched.schedule()
        reply = worker.execute(out)
        reply.logprobs = []                                   # the runner sent none
        assert sched.update_from_output(out, reply) == []
    (final,) = [TokenUpdate.final(r, [], []) for r in
                sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)]
    assert final.new_token_ids == aborted.output_token_ids and len(final.new_token_ids) == 3
    assert final.new_logprobs == [] and final.finish_reason == RequestStatus.FINISHED_ABORTED


def test_updates_carry_the_finish_facts_the_output_processor_reads():
    # The scheduler's update is the object handed to the serving side: what it reads is copied
    # in when the update is made (finish reason, stop token, times, cached tokens).
    sched, worker = make(sample_fn=lambda state: 7 if len(state.tokens) >= 3 else 40)
    stopped = make_request("stopped", [3, 4, 5], max_tokens=10, stop_token_ids=(7,))
    capped = make_request("capped", [3, 4, 6], max_tokens=2)
    sched.add_request(stopped)
    sched.add_request(capped)
    updates = run_steps(sched, worker)
    by_id = {rid: [u for u in updates if u.request_id == rid] for rid in ("stopped", "capped")}
    for rid, request in (("stopped", stopped), ("capped", capped)):
        *running, final = by_id[rid]
        assert all(u.finish_reason is None and u.finish_time is None for u in running)
        assert final.finished and final.finish_reason == request.status
        assert final.finish_time == request.finish_time is not None
        assert final.first_token_time == request.first_token_time is not None
        assert final.first_scheduled_time == request.first_scheduled_time is not None
        assert all(u.num_cached_tokens == request.num_cached_tokens >= 0 for u in by_id[rid])
        assert all(u.request is request for u in by_id[rid])
    assert by_id["stopped"][-1].stop_token_id == 7
    assert stopped.status == RequestStatus.FINISHED_STOP_TOKEN
    assert by_id["capped"][-1].stop_token_id is None
    assert capped.status == RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompts_at_the_length_edges(async_scheduling):
    """Driven synchronously and with two steps in flight. max_model_len 16 with a 16-token
    cache (4 blocks of 4): a prompt of 15 samples exactly one token and computes 15 positions
    (the sampled one never); a 16-token prompt is refused (no room for a token), with or
    without max_tokens. With a 12-token cache under a max_model_len of 16, a 12-token prompt
    fills the cache and still samples its one token."""
    for num_blocks, prompt_len, max_tokens in ((4, 15, None), (4, 15, 1), (3, 12, None),
                                               (3, 12, 4)):
        sched, worker = make(num_blocks=num_blocks, max_model_len=16,
                             async_scheduling=async_scheduling)
        req = make_request("edge", range(3, 3 + prompt_len), max_tokens=max_tokens)
        sched.add_request(req)
        (run_async if async_scheduling else run_steps)(sched, worker)
        assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 1
        assert sum(sum(t.values()) for t in worker.step_tokens) == prompt_len
        step(sched, worker)
        assert_no_leak(sched)
    sched, _ = make(num_blocks=4, max_model_len=16, async_scheduling=async_scheduling)
    for max_tokens in (None, 1):
        with pytest.raises(RequestRejected, match="max_model_len"):
            sched.add_request(make_request("full", range(3, 19), max_tokens=max_tokens))
    assert sched.num_waiting == 0 and sched.num_free_blocks == 4
