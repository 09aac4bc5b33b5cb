"""Steady-state decode costs bytes per change, not per request: 256 requests all decoding, with
nothing else changing, encode to a diff of a few bytes."""
from __future__ import annotations

import random

from engine_common.codec import encode_scheduler_output
from engine_common.config import SchedulerConfig
from engine_common.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from tests.support.scheduler_sim import SimWorker

NUM_REQUESTS = 256


def test_steady_state_diff_is_8_bytes():
    # block_size 16, prompts of 4 and at most 8 outputs: one block each, never a new one.
    config = SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=2048,
                             max_model_len=64, block_size=16)
    sched = Scheduler(config, num_blocks=NUM_REQUESTS, rng=random.Random(0))
    worker = SimWorker(NUM_REQUESTS, 16)
    for i in range(NUM_REQUESTS):
        sched.add_request(Request(f"r{i}", [i % 97 + 3, 5, 6, 7], SamplingParams(),
                                  StoppingParams(max_tokens=8)))
    first = sched.schedule()
    assert len(first.new_requests) == NUM_REQUESTS
    sched.update_from_output(first, worker.execute(first))
    for _ in range(3):
        out = sched.schedule()
        size = len(encode_scheduler_output(out))
        print(f"steady-state diff for {NUM_REQUESTS} decoding requests: {size} bytes")
        assert size <= 8     # README: 8 bytes, whatever the number of requests
        assert len(worker.batch) == NUM_REQUESTS
        updates = sched.update_from_output(out, worker.execute(out))
        assert len(updates) == NUM_REQUESTS and not any(u.finished for u in updates)
    assert worker.step_tokens[-1] == {h: 1 for h in range(NUM_REQUESTS)}
