"""Speculative decoding with async scheduling (docs/speculative-decoding.md), against the
greedy-verifying SpecSimWorker with two steps in flight: step t+1 is scheduled before step t's
tokens are back, so its drafts assume step t's drafts accepted and guess its last token
(spec_assumed); the worker drops those whose assumption fails. Every request ends with the
tokens of one-token sync decoding, with max_tokens and stop ids inside runs, aborts while
steps are in flight, preemption, and nothing leaks; the counters are what the worker
verified."""
from __future__ import annotations

import random
from collections import deque

import pytest

from engine_common.request.params import StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from tests.support.scheduler_sim import assert_no_leak, make, make_request, run_steps
from tests.support.spec_sim import SpecSimWorker, periodic_sample
from tests.unit.scheduler_service.core.test_spec_decode import SPEC, _requests


def run_async(sched, worker, on_step=None, max_steps: int = 3000) -> None:
    """Two steps in flight: schedule and run step t+1, then apply step t's output."""
    in_flight = deque()
    for _ in range(max_steps):
        if not (sched.has_unfinished_requests() or in_flight):
            return
        if sched.has_unfinished_requests():
            out = sched.schedule()
            in_flight.append((out, worker.execute(out)))
            if len(in_flight) < 2:
                continue
        out, result = in_flight.popleft()
        sched.update_from_output(out, result)
        if on_step is not None:
            on_step(sched)
    raise AssertionError("requests left after max_steps")


def _run(requests, sample, spec: bool, asynchronous: bool, num_blocks=64, on_step=None,
         window: int = 0, **cfg):
    sched, _ = make(num_blocks=num_blocks, sample_fn=sample, sliding_window=window,
                    speculative_config=SPEC if spec else None,
                    async_scheduling=asynchronous, **cfg)
    worker = SpecSimWorker(num_blocks, sched.config.block_size, sample_fn=sample,
                           window=window)
    reqs = [make_request(rid, prompt, **kw) for rid, prompt, kw in requests]
    for r in reqs:
        sched.add_request(r)
    if asynchronous:
        run_async(sched, worker, on_step)
    else:
        run_steps(sched, worker)
    assert_no_leak(sched)
    return [(r.output_token_ids, r.status) for r in reqs], sched, worker


@pytest.mark.parametrize("noise", [0, 5, 7])
def test_same_tokens_as_sync_and_no_speculation(noise):
    sample = periodic_sample(3, noise)
    want, _, _ = _run(_requests(), sample, spec=False, asynchronous=False)
    sync, _, _ = _run(_requests(), sample, spec=True, asynchronous=False)
    got, sched, worker = _run(_requests(), sample, spec=True, asynchronous=True)
    assert got == want == sync
    assumed = [h for d in worker.diffs for h in d.spec_assumed]
    assert assumed, "async steps should draft over the step in flight"
    assert worker.verified
    assert max(n for step in worker.produced for n in step.values()) > 1
    # The counters are exactly what the worker verified (dropped drafts are not counted).
    stats = sched.spec.stats
    assert stats.num_drafts == len(worker.verified)
    assert stats.num_draft_tokens == sum(k for k, _ in worker.verified)
    assert stats.num_accepted_tokens == sum(a for _, a in worker.verified) > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert stats.num_dropped == worker.dropped
    # Without noise a guess fails only on the prompts ending in a repeated token ([.., 7, 7]:
    # the proposer continues that period 1, the model period 3), once each. With noise more
    # fail, and a failed one does not fail the steps after it (they assume the one token a
    # dropped step makes): most drafts are still verified.
    period_one_tails = sum(prompt[-1] == prompt[-2] for _, prompt, _ in _requests())
    if noise:
        assert worker.dropped > period_one_tails
    else:
        assert worker.dropped == period_one_tails == 2
    assert len(worker.verified) > worker.dropped


def test_fewer_steps_than_async_without_drafts():
    sample = periodic_sample(3)
    _, _, plain = _run(_requests(), sample, spec=False, asynchronous=True)
    _, _, spec = _run(_requests(), sample, spec=True, asynchronous=True)
    assert len(spec.diffs) < len(plain.diffs)


@pytest.mark.parametrize("max_tokens", range(1, 14))
def test_max_tokens_inside_a_run(max_tokens):
    """Drafts (and the pending ones in flight) never ask past max_tokens."""
    sample = periodic_sample(3)
    reqs = [("a", [11, 12, 13, 11, 12, 13], {"max_tokens": max_tokens})]
    want, _, _ = _run(reqs, sample, spec=False, asynchronous=False)
    got, _, worker = _run(reqs, sample, spec=True, asynchronous=True)
    assert got == want and len(got[0][0]) == max_tokens
    computed = sum(n for step in worker.produced for n in step.values())
    assert computed == max_tokens     # no token sampled past it, not even one dropped


def test_stop_id_inside_a_run():
    sample = periodic_sample(4)
    prompt = [11, 12, 13, 14, 11, 12, 13, 14]
    free, _, _ = _run([("a", prompt, {"max_tokens": 20})], sample, False, False)
    for stop in {free[0][0][i] for i in (2, 5, 6, 9)}:
        reqs = [("a", prompt, {"max_tokens": 20, "stop_token_ids": (stop,)})]
        want, _, _ = _run(reqs, sample, False, False)
        got, _, _ = _run(reqs, sample, True, True)
        assert got == want and got[0][1] == RequestStatus.FINISHED_STOP_TOKEN


def test_preemption_while_drafts_are_in_flight():
    """A pool too small for every request: requests are preempted with drafted steps in
    flight, resumed, and still end with the tokens of one-token decoding."""
    sample = periodic_sample(3, 7)
    reqs = _requests(8, max_tokens=24)
    want, _, _ = _run(reqs, sample, False, False, num_blocks=14)
    preempted = []

    def watch(sched):
        preempted.extend(r for r in sched.waiting if r.num_preemptions)
    got, sched, worker = _run(reqs, sample, True, True, num_blocks=14, on_step=watch)
    assert got == want
    assert preempted and sched.spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("seed", range(4))
def test_aborts_while_steps_are_in_flight(seed):
    """Requests aborted at random steps (drafts in flight or not): the others' tokens are
    those of one-token decoding, nothing leaks, every pending count returns to 0."""
    rng = random.Random(seed)
    sample = periodic_sample(3, 5)
    reqs = _requests(8, max_tokens=20)
    want, _, _ = _run(reqs, sample, False, False)
    aborted, calls = set(), [0]

    def abort(sched):
        live = [r for r in sched._requests.values()]
        calls[0] += 1
        if live and (calls[0] == 3 or rng.random() < 0.15):
            victim = rng.choice(live)
            aborted.add(victim.request_id)
            sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
        for r in sched._requests.values():
            assert r.num_pending_tokens >= 0
    got, sched, _ = _run(reqs, sample, True, True, on_step=abort)
    assert aborted
    for (rid, _, _), g, w in zip(reqs, got, want):
        if rid not in aborted:
            assert g == w
        else:
            assert g[1] == RequestStatus.FINISHED_ABORTED and g[0] == w[0][:len(g[0])]


def test_min_tokens_masks_a_stop_id_inside_a_run():
    """A stop id that min_tokens masks at first: one-token decoding's tokens still."""
    sample = periodic_sample(3)
    prompt = [11, 12, 13, 11, 12, 13]
    free, _, _ = _run([("a", prompt, {"max_tokens": 16})], sample, False, False)
    stop = free[0][0][1]
    reqs = [("a", prompt, {"max_tokens": 16, "stop_token_ids": (stop,), "min_tokens": 4})]
    want, _, _ = _run(reqs, sample, False, False)
    got, _, _ = _run(reqs, sample, True, True)
    assert got == want and got[0][1] == RequestStatus.FINISHED_STOP_TOKEN
    assert len(got[0][0]) > 4


def test_max_model_len_inside_a_run():
    """Requests that end at max_model_len (no max_tokens): drafts and pending tokens never
    reach past the last position; the tokens of one-token decoding."""
    sample = periodic_sample(3)
    reqs = [(f"m{n}", ([11, 12, 13] * 8)[:n], {"max_tokens": None}) for n in (3, 5, 8, 13, 20)]
    want, _, _ = _run(reqs, sample, False, False, max_model_len=24)
    got, sched, worker = _run(reqs, sample, True, True, max_model_len=24)
    assert got == want
    assert [len(out) for out, _ in got] == [21, 19, 16, 11, 4]
    assert sched.spec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("noise", [3, 5, 7])
def test_a_sliding_window_frees_only_what_rejected_drafts_cannot_need(noise):
    """With a window the scheduler frees blocks no query will see. A step scheduled while a
    drafted step is in flight counts those drafts as computed; freeing from that count would
    free a block the queries need once the drafts are rejected (the worker's window reads
    another request's keys there). A pool barely larger than the windows makes freed blocks
    come back at once: the tokens are those of sync decoding without speculation."""
    sample = periodic_sample(3, noise)
    reqs = _requests(n=6, max_tokens=60)
    want, _, _ = _run(reqs, sample, spec=False, asynchronous=False, window=6, num_blocks=14)
    got, sched, worker = _run(reqs, sample, spec=True, asynchronous=True, window=6,
                              num_blocks=14)
    assert got == want
    assert worker.dropped > 0 and any(k > a for k, a in worker.verified)
