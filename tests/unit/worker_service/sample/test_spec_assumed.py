"""Drafts proposed over a step in flight (async scheduling: SchedulerOutput.spec_assumed) on a
real ModelRunner (tiny model, fp32): drafts whose assumption holds are verified as any; those
whose length or guessed last token is wrong are dropped and the handle computes its one token
where it really is (the tokens of one-token greedy steps either way); bad assumptions are
refused naming the field; a step after drafts waits for their host tokens."""
from __future__ import annotations

import pytest

from engine_common.wire.codec import decode_scheduler_output, encode_scheduler_output
from engine_common.wire.diff import SchedulerOutput
from tests.support.garbage_diffs import PROMPT, new
from tests.unit.worker_service.sample.test_spec_verify import _prefill, _runner
from worker_service.batch.diff_check import BadDiff


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models("qwen3")


@pytest.fixture(scope="module")
def greedy(model) -> list[int]:
    """One-token greedy steps' tokens after the prompt."""
    ref = _runner(model)
    first = _prefill(ref)
    return [first] + [ref.execute_diff(SchedulerOutput(s)).sampled_token_ids[0]
                      for s in range(1, 12)]


def test_codec_round_trip():
    diff = SchedulerOutput(5, num_scheduled_tokens={3: 3}, spec_token_ids={3: [7, 8]},
                           spec_assumed={3: [40, 9]})
    assert decode_scheduler_output(encode_scheduler_output(diff)) == diff
    assert len(encode_scheduler_output(SchedulerOutput(5))) == 8     # steady: unchanged


def test_assumptions_that_hold_verify_and_those_that_fail_drop(model, greedy):
    run = _runner(model)
    assert _prefill(run) == greedy[0]
    n = len(PROMPT)
    # Step 1 drafts two right tokens; step 2 assumed both accepted and guessed the bonus.
    out = run.execute_diff(SchedulerOutput(1, num_scheduled_tokens={0: 3},
                                           spec_token_ids={0: greedy[1:3]}))
    assert out.sampled_token_ids == greedy[1:4]
    assert run.needs_host_tokens(SchedulerOutput(2))         # the step after drafts waits
    out = run.execute_diff(SchedulerOutput(2, num_scheduled_tokens={0: 3},
                                           spec_token_ids={0: greedy[4:6]},
                                           spec_assumed={0: [n + 4, greedy[3]]}))
    assert out.sampled_token_ids == greedy[4:7]               # verified: 2 accepted + bonus
    # A wrong guess of the last token: dropped, one token at the right position.
    wrong = (greedy[6] + 1) % run.vocab_size
    out = run.execute_diff(SchedulerOutput(3, num_scheduled_tokens={0: 3},
                                           spec_token_ids={0: greedy[7:9]},
                                           spec_assumed={0: [n + 7, wrong]}))
    assert out.handles == [0] and out.sampled_token_ids == [greedy[7]]
    row = run.batch.handle_to_row[0]
    assert (run.batch.num_tokens[row], run.batch.num_computed[row]) == (n + 8, n + 7)
    # A wrong length (the scheduler assumed drafts accepted that were not): dropped too.
    out = run.execute_diff(SchedulerOutput(4, num_scheduled_tokens={0: 2},
                                           spec_token_ids={0: [greedy[9]]},
                                           spec_assumed={0: [n + 10, greedy[7]]}))
    assert out.sampled_token_ids == [greedy[8]]
    assert not run.needs_host_tokens(SchedulerOutput(5))     # no drafts launched last
    assert run.execute_diff(SchedulerOutput(5)).sampled_token_ids == [greedy[9]]


@pytest.mark.parametrize("assumed, match", [
    ({1: [8, 5]}, r"spec_assumed\[1\]=\[8, 5\] is invalid: must be absent: the handle has no "
                  r"spec_token_ids"),
    ({0: [8]}, r"spec_assumed\[0\]=\[8\] is invalid: must be \[num tokens, last token id\]"),
    ({0: [0, 5]}, r"spec_assumed\[0\]\[0\]=0 is invalid: must be in \[1, 63\]"),
    ({0: [64, 5]}, r"spec_assumed\[0\]\[0\]=64 is invalid: must be in \[1, 63\]"),
    ({0: [8, 10**6]}, r"spec_assumed\[0\]\[1\]=1000000 is invalid: must be < vocab_size"),
])
def test_bad_assumptions_are_refused(model, assumed, match):
    run = _runner(model)
    run.execute_diff(SchedulerOutput(0, new_requests=[new(), new(1, blocks=[4, 5])],
                                     num_scheduled_tokens={0: len(PROMPT), 1: len(PROMPT)}))
    with pytest.raises(BadDiff, match=match):
        run.execute_diff(SchedulerOutput(1, num_scheduled_tokens={0: 2},
                                         spec_token_ids={0: [5]}, spec_assumed=assumed))
    assert run.last_step == 0
