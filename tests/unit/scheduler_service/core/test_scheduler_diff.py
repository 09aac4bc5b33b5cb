"""Steady-state decode costs bytes per change, not per request: 256 requests all decoding, with
nothing else changing, encode to a diff of a few bytes; when they grow blocks, about a byte more
per growing request; structured-output constraints travel once, with the new requests, and add
nothing after."""
from __future__ import annotations

import random
import statistics
from array import array

from engine_common.wire.codec import decode_scheduler_output, encode_scheduler_output
from engine_common.constraints.constraint import Constraint
from engine_common.configuration.config import SchedulerConfig
from engine_common.wire.diff import RunnerOutput
from engine_common.request.params import SamplingParams, StoppingParams
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


def _decode_step(sched: Scheduler, step: int) -> RunnerOutput:
    """What a worker returns for a step: one token (7) for every request whose scheduled tokens
    reach its known ones (the others are mid-prefill)."""
    scheduled = sched.scheduled_tokens(step)
    handles = [r.handle for r in sched.running
               if r.handle in scheduled and r.num_computed_tokens >= r.num_tokens]
    return RunnerOutput(step, handles, [7] * len(handles), [-0.5] * len(handles))


def test_steady_state_diff_with_block_growth_is_small():
    """256 decoding requests with prompts of 100-300 tokens: about 16 take a new block every
    step (block size 16). README: the encoded diff stays under 64 bytes (median)."""
    config = SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=2048,
                             max_model_len=1024, block_size=16)
    sched = Scheduler(config, num_blocks=NUM_REQUESTS * 24, rng=random.Random(0))
    rng = random.Random(1)
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 30000) for _ in range(rng.randint(100, 300))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(),
                                  StoppingParams(max_tokens=200), eos_token_ids=(2,)))
    sizes, growing = [], []
    for _ in range(200):
        out = sched.schedule()
        payload = encode_scheduler_output(out)
        assert decode_scheduler_output(payload) == out
        if sched.num_running == NUM_REQUESTS and not out.new_requests \
                and not out.num_scheduled_tokens:        # every request decodes one token
            sizes.append(len(payload))
            growing.append(len(out.new_block_ids))
        sched.update_from_output(out, _decode_step(sched, out.step))
        if len(sizes) == 64:
            break
    assert len(sizes) == 64 and statistics.median(growing) >= 10
    print(f"diff with block growth: median {statistics.median(sizes)} bytes, max {max(sizes)}")
    assert statistics.median(sizes) <= 64


CONSTRAINTS = [
    Constraint("json_schema", '{"type": "object", "properties": {"name": {"type": "string"}, '
                              '"age": {"type": "integer"}}, "required": ["name", "age"]}'),
    Constraint("json_object", True), Constraint("regex", "[0-9]{3}-[0-9]{4}"),
    Constraint("grammar", 'start: "yes" | "no"'), Constraint("choice", ("red", "green")),
]


def test_steady_state_diff_with_256_constrained_requests_stays_under_100_bytes():
    """The same growing workload, every request constrained: the constraints go out once, in
    the new-request part; steady-state decode steps stay under 100 bytes (the issue's bar)."""
    config = SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=2048,
                             max_model_len=1024, block_size=16)
    sched = Scheduler(config, num_blocks=NUM_REQUESTS * 24, rng=random.Random(0))
    rng = random.Random(1)
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 30000) for _ in range(rng.randint(100, 300))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(),
                                  StoppingParams(max_tokens=200), eos_token_ids=(2,),
                                  constraint=CONSTRAINTS[i % len(CONSTRAINTS)]))
    sizes, sent = [], []
    for _ in range(200):
        out = sched.schedule()
        payload = encode_scheduler_output(out)
        decoded = decode_scheduler_output(payload)
        assert decoded == out
        sent += [r.constraint for r in decoded.new_requests]
        if sched.num_running == NUM_REQUESTS and not out.new_requests \
                and not out.num_scheduled_tokens:
            sizes.append(len(payload))
        reply = _decode_step(sched, out.step)
        reply.compiled_handles = [r.handle for r in out.new_requests]    # compiled at once
        sched.update_from_output(out, reply)
        if len(sizes) == 64:
            break
    assert sent == [CONSTRAINTS[i % len(CONSTRAINTS)] for i in range(NUM_REQUESTS)]
    print(f"constrained steady state: median {statistics.median(sizes)} bytes, max {max(sizes)}")
    assert len(sizes) == 64 and max(sizes) < 100


def test_new_requests_carry_the_admission_bytes_and_encode_as_their_ids():
    """A new request's prompt travels as the uint32 bytes made at admission (no second
    conversion); the payload is the one the ids alone would encode to, and decodes to them."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128,
                             block_size=16)
    sched = Scheduler(config, num_blocks=32, rng=random.Random(0))
    prompts = [[3, 70000, 5] * 11, [2**32 - 1, 0, 9]]
    for i, ids in enumerate(prompts):
        sched.add_request(Request(f"r{i}", ids, SamplingParams(), StoppingParams(max_tokens=4)))
    out = sched.schedule()
    assert [r.prompt_u32 for r in out.new_requests] == [
        array("I", ids).tobytes() for ids in prompts]
    payload = encode_scheduler_output(out)
    for r in out.new_requests:
        r.prompt_u32 = None                     # the ids alone
    assert encode_scheduler_output(out) == payload
    decoded = decode_scheduler_output(payload)
    assert [d.prompt_token_ids.tolist() for d in decoded.new_requests] == prompts
    assert decoded.new_requests == out.new_requests
