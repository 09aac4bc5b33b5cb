"""The scheduler's rules for pooling requests: none samples, each ends on its vector; an
encoder's (WHOLE_PROMPT) is admitted only with its whole prompt in the step (never chunked, not
even past long_prefill_token_threshold), waits in order while the step has no room for it, and
is refused when no step could ever hold it."""
from __future__ import annotations

import random

import pytest

from engine_common.configuration.config import SchedulerConfig
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.request.pooling import (CLS, NORMALIZE, POOL_SAMPLING, POOL_STOPPING,
                                           WHOLE_PROMPT)
from engine_common.wire.diff import RunnerOutput
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import RequestRejected, Scheduler

ENCODER = CLS | NORMALIZE | WHOLE_PROMPT


def _scheduler(**cfg) -> Scheduler:
    config = SchedulerConfig(**{"block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 16,
                                "max_model_len": 64, **cfg})
    return Scheduler(config, 64, rng=random.Random(0))


def _pool(rid: str, n: int, code: int = ENCODER) -> Request:
    return Request(rid, list(range(3, 3 + n)), POOL_SAMPLING, POOL_STOPPING, (2,),
                   num_logprobs=None, pooling=code)


def test_an_encoder_prompt_waits_for_a_step_with_room_for_all_of_it():
    sched = _scheduler(long_prefill_token_threshold=8)
    gen = Request("g", list(range(3, 11)), SamplingParams(seed=1), StoppingParams(max_tokens=4),
                  (2,))
    sched.add_request(gen)
    enc, after = _pool("e", 12), _pool("later", 2)
    sched.add_request(enc)
    sched.add_request(after)
    out = sched.schedule()           # g's 8 tokens leave 8: e waits, and so does the one after
    assert [r.handle for r in out.new_requests] == [gen.handle]
    assert enc.status == RequestStatus.WAITING and after.status == RequestStatus.WAITING
    sched.update_from_output(out, RunnerOutput(out.step, [gen.handle], [7], [-0.1]))
    out = sched.schedule()           # g decodes 1: e's 12 fit whole (past the threshold of 8)
    assert [r.handle for r in out.new_requests] == [enc.handle, after.handle]
    assert out.num_scheduled_tokens[enc.handle] == 12
    assert out.new_requests[0].num_computed_tokens == 0
    updates = sched.update_from_output(out, RunnerOutput(
        out.step, [gen.handle], [8], [-0.1], pooled={enc.handle: [0.6, 0.8]}))
    done = [u for u in updates if u.request is enc]
    assert len(done) == 1 and done[0].pooled == [0.6, 0.8] and done[0].new_token_ids == []
    assert enc.status == RequestStatus.FINISHED_LENGTH and enc.output_token_ids == []
    assert not sched.kv.get_block_ids(enc)              # its blocks freed with it
    assert after.status == RequestStatus.RUNNING        # its vector not back yet: idle, held
    out = sched.schedule()
    assert out.num_scheduled_tokens.get(after.handle, 0) == 0
    assert enc.handle in out.finished_handles


def test_a_decoder_pooling_request_is_chunked_and_ends_on_its_vector():
    sched = _scheduler()
    req = _pool("d", 20, code=CLS)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens[req.handle] == 16           # chunked: not WHOLE_PROMPT
    assert sched.update_from_output(out, RunnerOutput(out.step)) == []
    out = sched.schedule()
    assert out.num_scheduled_tokens[req.handle] == 4
    out2 = sched.schedule()                              # async: the vector is still out
    assert out2.num_scheduled_tokens.get(req.handle, 0) == 0
    [update] = sched.update_from_output(out, RunnerOutput(out.step, pooled={req.handle: [1.0]}))
    assert update.finished and update.pooled == [1.0] and req.output_token_ids == []
    assert sched.update_from_output(out2, RunnerOutput(out2.step)) == []


@pytest.mark.parametrize("n, field, allowed", [
    (17, "prompt tokens", "<= max_num_batched_tokens (16): an encoder model computes a prompt "
                          "in one step"),
    (65, "prompt tokens", "<= max_model_len (64)"),
])
def test_a_prompt_no_step_could_hold_is_refused(n, field, allowed):
    sched = _scheduler() if n < 64 else _scheduler(max_num_batched_tokens=128)
    with pytest.raises(RequestRejected) as err:
        sched.add_request(_pool("x", n))
    assert (err.value.field, err.value.value, err.value.allowed) == (field, n, allowed)


def test_a_pooling_prompt_may_fill_max_model_len():
    sched = _scheduler(max_num_batched_tokens=64)
    req = _pool("full", 64)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens[req.handle] == 64
