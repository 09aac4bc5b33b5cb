"""The codec's inline new-request decode (_usual_new_request) against the checked one
(_checked_new_request) on seeded random mutations of a valid request: wrong types, bools where
ints are expected, negative and 64-bit numbers, odd byte lengths, short and long lists. The
inline path never accepts what the checked path refuses, decodes what it accepts to the same
request, and raises nothing but CodecError."""
from __future__ import annotations

import random

import msgpack

from engine_common.request.params import SamplingParams, WorkerSamplingParams
from engine_common.wire.codec import (CodecError, _checked_new_request, _usual_new_request,
                                      encode_scheduler_output)
from engine_common.wire.diff import NO_LOGPROBS, NewRequestData, SchedulerOutput

_SAMPLING_VALUES = [[b"", 0, 0, []], [b"", -1, 0, []], [b"", 0, True, []],
                    [b"", 0, 0, [True]], [b"\xff", 0, 0, []], [b"", 0, 0, [1, -1]]]
_VALUES = [-1, 0, 1, True, False, 2**63, -2**63, None, 1.0, b"", b"abcd", b"abc", "x", [], [1],
           [True], [-1], [1, 2.0], {}, *_SAMPLING_VALUES]


def _plain() -> list:
    sampling = WorkerSamplingParams(SamplingParams(top_k=4), seed=7, min_tokens=2,
                                    stop_ids=(3, 9))
    out = SchedulerOutput(step=1, new_requests=[
        NewRequestData(3, [0, 5, 2**32 - 1], sampling, [1, 8], 2, NO_LOGPROBS)])
    return msgpack.unpackb(encode_scheduler_output(out), raw=False, strict_map_key=False)[1][0]


def _mutated(plain: list, rng: random.Random) -> list:
    value = list(plain)
    value[2] = list(value[2])
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.6 and len(value) == 7:
            value[rng.randrange(7)] = rng.choice(_VALUES)
        elif r < 0.9 and len(value) > 2 and type(value[2]) is list and len(value[2]) == 4:
            value[2][rng.randrange(4)] = rng.choice(_VALUES)
        elif rng.random() < 0.5:
            value = value[:rng.randint(0, 8)]
        else:
            value = value + [rng.choice(_VALUES)]
    return value


def test_the_inline_path_refuses_all_the_checked_path_refuses_and_agrees_on_the_rest():
    plain, rng = _plain(), random.Random(39)
    accepted = refused = 0
    for _ in range(3000):
        value = _mutated(plain, rng)
        try:
            fast = _usual_new_request(value)
        except CodecError:          # a bad sampling message: refused on both paths
            fast = CodecError
        try:
            slow = _checked_new_request(value)
        except (CodecError, ValueError):  # a bad constraint kind: ParamError (decode wraps it)
            slow = CodecError
        if fast is CodecError or fast is None:
            refused += slow is CodecError
            assert fast is None or slow is CodecError, value
        else:
            accepted += 1
            assert slow is not CodecError and fast == slow, value
            assert fast.prompt_logprobs == slow.prompt_logprobs, value
    assert accepted > 50 and refused > 1000          # both sides were exercised
