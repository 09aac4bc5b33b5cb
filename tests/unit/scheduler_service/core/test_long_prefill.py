"""Issue 23 item 3: one long prompt must not hold every other request back for its whole prefill.

The real scheduler against SimWorker (every diff through the codec, the fake KV cache checking
every block table), counting steps: a long prefill takes at most long_prefill_token_threshold
tokens of a step while others run or wait, and one long prefill at a time is in progress."""
from __future__ import annotations

import pytest

from engine_common.configuration.config import SchedulerConfig
from engine_common.request.params import ParamError
from tests.support.scheduler_sim import assert_no_leak, make, make_request, run_steps, step

LONG = 30_000
BUDGET = 2048
# The shapes: block size 16, the default budget, a cache that holds the long prompt.
SHAPE = dict(block_size=16, max_num_seqs=16, max_num_batched_tokens=BUDGET,
             max_model_len=32_768)
NUM_BLOCKS = LONG // 16 + 256


def long_request(rid="long", base=100, priority=0, arrival=None):
    return make_request(rid, [base + i % 1000 for i in range(LONG)], max_tokens=2,
                        priority=priority, arrival=arrival)


def short_request(rid, max_tokens=4, base=5000, arrival=None):
    return make_request(rid, range(base, base + 16), max_tokens=max_tokens, arrival=arrival)


def tokens_of(out, request):
    """Tokens the step computes for `request` (0 when it is not in the step)."""
    if any(n.handle == request.handle for n in out.new_requests) or \
            request.handle in out.num_scheduled_tokens:
        return out.num_scheduled_tokens.get(request.handle, 1)
    return 0


def test_alone_a_long_prompt_takes_the_whole_budget():
    sched, worker = make(num_blocks=NUM_BLOCKS, **SHAPE)
    long = long_request()
    sched.add_request(long)
    for _ in range(3):
        out, _ = step(sched, worker)
        assert tokens_of(out, long) == BUDGET


def test_new_short_request_is_scheduled_at_once_behind_a_30000_token_prefill():
    sched, worker = make(num_blocks=NUM_BLOCKS, **SHAPE)
    long = long_request()
    sched.add_request(long)
    for _ in range(3):
        step(sched, worker)
    short = short_request("short")
    sched.add_request(short)
    out, updates = step(sched, worker)          # the very next step
    assert [n.handle for n in out.new_requests] == [short.handle]
    assert tokens_of(out, short) == 16
    assert tokens_of(out, long) == SchedulerConfig(**SHAPE).long_prefill_threshold == 512
    assert [u.request.request_id for u in updates] == ["short"]     # its first token
    run_steps(sched, worker, max_steps=200)
    assert long.num_output_tokens == 2 and short.num_output_tokens == 4
    assert_no_leak(sched)


@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-older", "decode-newer"])
def test_running_decode_gets_a_token_every_step_while_a_long_prompt_prefills(decode_first):
    sched, worker = make(num_blocks=NUM_BLOCKS, **SHAPE)
    long, stream = long_request(), short_request("stream", max_tokens=100)
    first, second = (stream, long) if decode_first else (long, stream)
    sched.add_request(first)
    step(sched, worker)
    sched.add_request(second)
    steps = 0
    while not long.output_token_ids:
        before = stream.num_output_tokens
        out, _ = step(sched, worker)
        steps += 1
        assert stream.num_output_tokens == before + 1, f"step {steps}: no token for the stream"
        assert tokens_of(out, long) <= BUDGET - 1
    # The long prompt completes, and beside one stream it still takes all but a token a step.
    assert steps <= -(-LONG // (BUDGET - 1)) + 2
    run_steps(sched, worker, max_steps=200)
    assert stream.num_output_tokens == 100
    assert_no_leak(sched)


def test_many_short_requests_keep_the_long_prompt_moving_and_are_each_served_quickly():
    """A flood of short requests: each is scheduled the step after it arrives, and the long
    prefill still gets its threshold every step (nobody starves it either)."""
    sched, worker = make(num_blocks=NUM_BLOCKS, **SHAPE)
    long = long_request()
    sched.add_request(long)
    step(sched, worker)
    computed = long.num_computed_tokens
    for i in range(40):
        short = short_request(f"s{i}", max_tokens=2, base=5000 + 16 * i)
        sched.add_request(short)
        out, _ = step(sched, worker)
        assert tokens_of(out, short) == 16, f"s{i} not admitted in the step after it arrived"
        assert long.num_computed_tokens - computed >= 512
        computed = long.num_computed_tokens
    run_steps(sched, worker, max_steps=200)
    assert long.num_output_tokens == 2
    assert_no_leak(sched)


def test_one_long_prefill_at_a_time_and_short_requests_pass_a_waiting_long_one():
    sched, worker = make(num_blocks=2 * NUM_BLOCKS, **SHAPE)
    first, second = long_request("first", base=100), long_request("second", base=2000)
    short = short_request("short")
    sched.add_request(first)
    step(sched, worker)
    sched.add_request(second)
    sched.add_request(short)                    # queued behind the second long prompt
    out, _ = step(sched, worker)
    assert [n.handle for n in out.new_requests] == [short.handle]
    assert tokens_of(out, second) == 0 and sched.num_waiting == 1
    # The second waits while the first is a long prefill, which meanwhile takes all the
    # budget the short one leaves (nobody it could make room for is waiting).
    while (left := LONG - first.num_computed_tokens) > 512:
        out, _ = step(sched, worker)
        assert tokens_of(out, second) == 0
        assert tokens_of(out, first) >= min(BUDGET - 1, left)
    out, _ = step(sched, worker)
    assert tokens_of(out, second) == 512
    run_steps(sched, worker, max_steps=200)
    assert first.num_output_tokens == second.num_output_tokens == 2
    assert_no_leak(sched)


def test_a_more_urgent_long_prompt_is_not_held_back_by_a_less_urgent_one():
    sched, worker = make(num_blocks=2 * NUM_BLOCKS, **SHAPE)
    lazy = long_request("lazy", base=100, priority=5)
    sched.add_request(lazy)
    step(sched, worker)
    urgent = long_request("urgent", base=2000, priority=0)
    sched.add_request(urgent)
    out, _ = step(sched, worker)
    assert tokens_of(out, urgent) == 512
    run_steps(sched, worker, max_steps=200)
    assert_no_leak(sched)


def test_the_settings_are_validated_by_name():
    assert SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8).long_prefill_threshold == 64
    assert SchedulerConfig().long_prefill_threshold == 512
    assert SchedulerConfig(max_num_batched_tokens=4096).long_prefill_threshold == 1024
    assert SchedulerConfig(max_num_batched_tokens=16384).long_prefill_threshold == 4096
    with pytest.raises(ParamError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=0)
    with pytest.raises(ParamError, match="max_long_partial_prefills"):
        SchedulerConfig(max_long_partial_prefills=0)
    with pytest.raises(ParamError, match=r"max_long_partial_prefills x long_prefill_token_"
                                         r"threshold='3 x 1024' is invalid: must be <= max_num_batched_tokens"):
        SchedulerConfig(long_prefill_token_threshold=1024, max_long_partial_prefills=3)
