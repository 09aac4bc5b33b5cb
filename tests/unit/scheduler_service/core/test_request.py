"""The scheduler stamps when a request is first scheduled (reported as queued time in
GenerateResponse.timings), once."""
from __future__ import annotations

import time

from engine_common.configuration.config import SchedulerConfig
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler


def test_first_scheduled_time_is_set_once():
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, block_size=4,
                                      max_model_len=2048),
                      num_blocks=16)
    arrived = time.monotonic() - 0.5      # arrived half a second ago, without waiting for it
    first = Request("a", [1, 2, 3], SamplingParams(), StoppingParams(max_tokens=4),
                    arrival_time=arrived)
    second = Request("b", [4, 5, 6], SamplingParams(), StoppingParams(max_tokens=4),
                     arrival_time=arrived + 0.1)
    sched.add_request(first)
    sched.add_request(second)
    sched.schedule()
    assert first.first_scheduled_time is not None
    assert arrived + 0.5 <= first.first_scheduled_time <= time.monotonic()
    assert second.first_scheduled_time is None  # max_num_seqs=1: still waiting
    stamp = first.first_scheduled_time
    sched.schedule()
    assert first.first_scheduled_time == stamp
