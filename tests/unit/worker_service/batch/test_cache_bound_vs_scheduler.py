"""The worker's bound on cached requests (running + preempted: diff_limits.max_cached_requests)
never refuses a diff of a legal scheduler. The scheduler's own admission bounds what it has sent
and not finished by max_num_seqs + max_waiting; with MAX_WAITING lowered to the scheduler's
max_waiting, the worker's bound is exactly that, and every diff of a preempting, churning
scheduler passes the worker's check (worker_service/batch/diff_check.py) before the simulated
worker applies it."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from engine_common.request import diff_limits
from scheduler_service.core.admission import QueueFull
from tests.support.scheduler_sim import SimWorker, make, make_request
from worker_service.batch.diff_check import DiffBounds, check_diff


def _checked_step(sched, worker: SimWorker, bounds: DiffBounds) -> int:
    """One step whose diff first passes the worker's check against `worker`'s cache; returns
    how many requests the worker caches after it."""
    out = sched.schedule()
    cached = {h: SimpleNamespace(num_tokens=len(r.tokens)) for h, r in worker.reqs.items()}
    rows = {h: i for i, h in enumerate(worker.batch)}
    held = np.array([len(worker.reqs[h].block_ids) for h in worker.batch] or [0])
    check_diff(out, bounds, cached, rows, held)
    sched.update_from_output(out, worker.execute(out))
    return len(worker.reqs)


def _bounds(sched, num_blocks: int, max_waiting: int, patch) -> DiffBounds:
    patch.setattr(diff_limits, "MAX_WAITING", max_waiting)
    c = sched.config
    return DiffBounds(num_kv_blocks=num_blocks, vocab_size=1000, max_model_len=c.max_model_len,
                      max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                      block_size=c.block_size,
                      max_blocks_per_request=-(-c.max_model_len // c.block_size),
                      max_cached_requests=diff_limits.max_cached_requests(c.max_num_seqs))


def test_priority_preemption_reaches_the_bound_and_no_further(monkeypatch):
    """A full batch of low-priority requests is preempted by as many urgent ones: the worker
    caches max_num_seqs + max_waiting requests, the most the scheduler's admission allows (the
    preempted ones fill the waiting queue)."""
    sched, worker = make(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=16, max_waiting=2)
    bounds = _bounds(sched, 64, 2, monkeypatch)
    for i in range(2):
        sched.add_request(make_request(f"low{i}", [5, 6, 7], max_tokens=20, priority=1))
    assert _checked_step(sched, worker, bounds) == 2
    for i in range(2):
        sched.add_request(make_request(f"urgent{i}", [8, 9], max_tokens=20, priority=0))
    # One victim a step (for the head of the queue): 3 cached, then 4.
    assert [_checked_step(sched, worker, bounds) for _ in range(3)] == [3, 4, 4]
    assert bounds.max_cached_requests == 4
    assert sorted(r.request_id for r in sched.running) == ["urgent0", "urgent1"]
    with pytest.raises(QueueFull):                    # and fill the waiting queue
        sched.add_request(make_request("one-more", [1, 2], priority=0))


def test_churn_under_memory_and_priority_preemption_stays_within_the_bound(monkeypatch):
    rng = random.Random(5)
    sched, worker = make(num_blocks=10, max_num_seqs=4, max_num_batched_tokens=12,
                         max_model_len=32, max_waiting=6)
    bounds = _bounds(sched, 10, 6, monkeypatch)
    most, preempted = 0, 0
    for step in range(300):
        for _ in range(rng.randrange(3)):
            try:
                sched.add_request(make_request(
                    f"r{step}-{rng.random()}", [rng.randrange(3, 50) for _ in range(6)],
                    max_tokens=rng.randrange(4, 16), seed=step, priority=rng.randrange(3)))
            except QueueFull:
                pass
        most = max(most, _checked_step(sched, worker, bounds))
        preempted += len(worker.diffs[-1].preempted_handles)
    assert preempted > 20 and most > sched.config.max_num_seqs   # preempted ones were cached
    assert most <= bounds.max_cached_requests
