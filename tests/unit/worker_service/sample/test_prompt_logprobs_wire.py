"""Prompt logprobs on the step protocol: a new request's `prompt_logprobs` is an 8th element
only when asked (a diff without it encodes byte for byte as before), the reply's map is an 8th
field only when some request's are done (a reply without them as before), both round-trip, and
the worker's diff check refuses an out-of-range k, or one asked with a prefix hit (the
positions before the hit would have no logprobs)."""
from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from engine_common.wire.codec import (decode_runner_output, decode_scheduler_output,
                                      encode_runner_output)
from engine_common.wire.diff import NO_LOGPROBS, PromptLogprobs, RunnerOutput, SchedulerOutput
from tests.support.garbage_diffs import enc, new
from worker_service.batch.diff_check import BadDiff, DiffBounds, check_diff


def _bounds() -> DiffBounds:
    return DiffBounds(num_kv_blocks=10, vocab_size=100, max_model_len=32, max_num_seqs=2,
                      max_num_batched_tokens=16, block_size=4, max_blocks_per_request=8,
                      max_cached_requests=6)


def _check(diff: SchedulerOutput) -> None:
    check_diff(diff, _bounds(), {}, {}, np.zeros(2, dtype=np.int32))


def test_the_diff_field_travels_only_when_asked():
    plain = SchedulerOutput(0, new_requests=[new()])
    asked = SchedulerOutput(0, new_requests=[dataclasses.replace(new(), prompt_logprobs=3)])
    assert len(msgpack.unpackb(enc(plain))[1][0]) == 7
    assert len(msgpack.unpackb(enc(asked))[1][0]) == 8
    for diff in (plain, asked):
        assert decode_scheduler_output(enc(diff)) == diff
        _check(diff)
    assert decode_scheduler_output(enc(plain)).new_requests[0].prompt_logprobs == NO_LOGPROBS


@pytest.mark.parametrize("k,computed,message", [
    (101, 0, r"new_requests\[0\]\.prompt_logprobs=101 is invalid: must be in \[-1, 100\]"),
    (2, 4, r"new_requests\[0\]\.num_computed_tokens=4 is invalid: must be 0 for a request "
           r"that asks for prompt logprobs"),
])
def test_the_worker_refuses_what_it_cannot_compute(k, computed, message):
    diff = SchedulerOutput(0, new_requests=[dataclasses.replace(
        new(computed=computed), prompt_logprobs=k)])
    with pytest.raises(BadDiff, match=message):
        _check(diff)


def test_the_reply_field_travels_only_when_some_are_done():
    plain = RunnerOutput(5, [1, 2], [7, 8], [-0.5, -1.5])
    assert len(msgpack.unpackb(encode_runner_output(plain))) == 5
    done = PromptLogprobs(np.array([-1.0, -2.5], np.float32), np.array([1, 4]),
                          np.array([3, 9, 3, 11]), np.array([-1.0, -2.0, -0.5, -1.75],
                                                            np.float32))
    asked = dataclasses.replace(plain, prompt_logprobs={2: done})
    fields = msgpack.unpackb(encode_runner_output(asked), strict_map_key=False)
    assert len(fields) == 8
    got = decode_runner_output(encode_runner_output(asked))
    assert got.prompt_logprobs == {2: PromptLogprobs([-1.0, -2.5], [1, 4], [3, 9, 3, 11],
                                                     [-1.0, -2.0, -0.5, -1.75])}
    assert got.prompt_logprobs[2].k == 2
    assert decode_runner_output(encode_runner_output(plain)).prompt_logprobs == {}
