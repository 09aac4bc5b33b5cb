"""Speculative drafts in the step diff on a real ModelRunner (tiny model, fp32): the codec keeps
steady steps as small as before, bad drafts are refused naming the field, and a drafted step
returns the accepted drafts plus one token: exactly the tokens of one-token greedy steps, with
the rows' counts rolled back over the rejected drafts."""
from __future__ import annotations

import pytest

from engine_common.wire.codec import (decode_runner_output, decode_scheduler_output,
                                      encode_runner_output, encode_scheduler_output)
from engine_common.wire.diff import SchedulerOutput
from tests.support.garbage_diffs import PROMPT, new
from worker_service.batch.diff_check import BadDiff
from worker_service.config import RunnerConfig
from worker_service.failures import StepProtocolError
from worker_service.runner.model_runner import ModelRunner

LIMITS = dict(block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models("qwen3")


def _runner(model: str) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model_dir=model, dtype="float32", **LIMITS))
    runner.init_kv_cache(64)
    return runner


def _prefill(runner: ModelRunner) -> int:
    out = runner.execute_diff(SchedulerOutput(0, new_requests=[new(blocks=list(range(8)))],
                                              num_scheduled_tokens={0: len(PROMPT)}))
    return out.sampled_token_ids[0]


def test_codec_round_trip_and_steady_size():
    plain = SchedulerOutput(5)
    assert len(encode_scheduler_output(plain)) == 8          # unchanged: no drafts, no field
    drafted = SchedulerOutput(5, num_scheduled_tokens={3: 4}, spec_token_ids={3: [7, 8, 9]})
    assert decode_scheduler_output(encode_scheduler_output(drafted)) == drafted


def test_greedy_reference_and_drafted_steps_agree(model):
    ref = _runner(model)
    first = _prefill(ref)
    greedy = [first] + [ref.execute_diff(SchedulerOutput(s)).sampled_token_ids[0]
                        for s in range(1, 9)]
    # Drafts: the next three tokens right, then a wrong one: 3 accepted + the correction.
    run = _runner(model)
    assert _prefill(run) == first
    wrong = (greedy[4] + 1) % run.vocab_size
    out = run.execute_diff(SchedulerOutput(1, num_scheduled_tokens={0: 5},
                                           spec_token_ids={0: greedy[1:4] + [wrong]}))
    assert out.handles == [0] * 4 and out.sampled_token_ids == greedy[1:5]
    assert len(out.logprobs) == 4
    row = run.batch.handle_to_row[0]
    n = len(PROMPT) + 5
    assert run.batch.num_tokens[row] == n and run.batch.num_computed[row] == n - 1
    # All drafts right: every one accepted plus the bonus token.
    out = run.execute_diff(SchedulerOutput(2, num_scheduled_tokens={0: 3},
                                           spec_token_ids={0: greedy[5:7]}))
    assert out.sampled_token_ids == greedy[5:8]
    # A plain step after: the KV of the accepted run is right.
    out = run.execute_diff(SchedulerOutput(3))
    assert out.sampled_token_ids == [greedy[8]]


def test_bad_drafts_are_refused(model):
    run = _runner(model)
    _prefill(run)
    with pytest.raises(BadDiff, match=r"num_scheduled_tokens\[0\]=1 is invalid: must be 1 \+ "
                                      r"the 2 drafts"):
        run.execute_diff(SchedulerOutput(1, spec_token_ids={0: [5, 6]}))
    with pytest.raises(BadDiff, match=r"spec_token_ids\[0\]\[1\]=\d+ is invalid: must be < "
                                      r"vocab_size"):
        run.execute_diff(SchedulerOutput(1, num_scheduled_tokens={0: 3},
                                         spec_token_ids={0: [5, run.vocab_size]}))
    with pytest.raises(StepProtocolError, match="not in the batch"):
        run.execute_diff(SchedulerOutput(1, num_scheduled_tokens={0: 2},
                                         spec_token_ids={0: [5], 9: [1]}))
    assert run.last_step == 0


def test_top_logprobs_of_every_token_of_a_drafted_step(model):
    """A top-logprob request drafts: each produced token carries its own logprob and top
    alternatives (k per token, token after token), those of one-token steps."""
    ref = _runner(model)
    first = ref.execute_diff(SchedulerOutput(0, new_requests=[new(logprobs=3)],
                                             num_scheduled_tokens={0: len(PROMPT)}))
    steps = [ref.execute_diff(SchedulerOutput(s)) for s in range(1, 6)]
    greedy = [first.sampled_token_ids[0]] + [o.sampled_token_ids[0] for o in steps]
    run = _runner(model)
    run.execute_diff(SchedulerOutput(0, new_requests=[new(logprobs=3)],
                                     num_scheduled_tokens={0: len(PROMPT)}))
    wrong = (greedy[4] + 1) % run.vocab_size
    out = run.execute_diff(SchedulerOutput(1, num_scheduled_tokens={0: 5},
                                           spec_token_ids={0: greedy[1:4] + [wrong]}))
    assert out.sampled_token_ids == greedy[1:5]
    ids, lps = out.top_logprobs[0]
    assert len(ids) == len(lps) == 4 * 3
    for t, one in enumerate(steps[:4]):
        want_ids, want_lps = one.top_logprobs[0]
        assert list(ids[3 * t:3 * t + 3]) == list(want_ids)
        assert abs(out.logprobs[t] - one.logprobs[0]) < 1e-5
        assert max(abs(a - b) for a, b in zip(lps[3 * t:3 * t + 3], want_lps)) < 1e-5
    wire = decode_runner_output(encode_runner_output(out))       # as the scheduler reads it
    assert wire.top_logprobs[0][0] == [int(i) for i in ids]
