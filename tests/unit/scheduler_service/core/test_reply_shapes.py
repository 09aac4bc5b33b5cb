"""A step reply's prompt logprobs and pooled vectors must fit the request they name
(reply_checks.py).

The API zips a request's prompt logprobs with its prompt ids: one position too many was an
IndexError where the servicer builds them (request_output.prompt_logprob_entries), one too
few a short list to the client; a pooled vector for a generating request ended it with a vector.
Each is now BadReply naming the field, the value and what it must be, and no request changes.
Values are not checked (a NaN logprob is the model's numerics on one request)."""
from __future__ import annotations

import math

import pytest

from engine_common.wire.diff import PromptLogprobs
from tests.unit.scheduler_service.core.test_reply_checks import _decoding, _refused


def _asking(k: int = 1):
    """_decoding's scheduler, its first request (prompt [3, 4, 5]) asking k prompt logprobs."""
    sched, worker, requests = _decoding()
    requests[0].num_prompt_logprobs = k
    return sched, worker, requests


def _entry(positions: int, k: int) -> PromptLogprobs:
    return PromptLogprobs([-0.5] * positions, [1] * positions, [7] * (positions * k),
                          [-0.5] * (positions * k))


@pytest.mark.parametrize("positions,k,match", [
    (3, 1, r"prompt_logprobs\[\d+\] \(positions\)=3 must be 2: one per prompt token after "
           r"the first"),
    (1, 1, r"prompt_logprobs\[\d+\] \(positions\)=1 must be 2"),
    (2, 2, r"prompt_logprobs\[\d+\] \(alternatives per position\)=2 must be 1: the request's "
           r"prompt_logprobs"),
])
def test_prompt_logprobs_of_the_wrong_shape_fail_the_step(positions, k, match):
    sched, worker, requests = _asking(k=1)

    def corrupt(reply):
        reply.prompt_logprobs = {requests[0].handle: _entry(positions, k)}
        return reply
    _refused(sched, worker, requests, corrupt, match)


def test_prompt_logprobs_for_a_request_that_asked_none_fail_the_step():
    sched, worker, requests = _decoding()

    def corrupt(reply):
        reply.prompt_logprobs = {requests[1].handle: _entry(2, 0)}
        return reply
    _refused(sched, worker, requests, corrupt,
             r"prompt_logprobs\[\d+\]='an entry' must be absent: the request asked for no "
             r"prompt logprobs")


def test_a_pooled_vector_for_a_generating_request_fails_the_step():
    sched, worker, requests = _decoding()

    def corrupt(reply):
        reply.pooled = {requests[2].handle: [0.25, 0.5]}
        return reply
    _refused(sched, worker, requests, corrupt,
             r"pooled\[\d+\]='a vector' must be absent: the request pools nothing")


def test_prompt_logprobs_of_the_right_shape_pass_nan_values_and_all():
    """The shape the request asked for passes, whatever its values: a NaN is one request's
    numerics, not a reason to end every tenant's stream."""
    sched, worker, requests = _asking(k=1)
    out = sched.schedule()
    reply = worker.execute(out)
    entry = _entry(2, 1)
    entry.logprobs[0] = math.nan
    reply.prompt_logprobs = {requests[0].handle: entry}
    updates = sched.update_from_output(out, reply)
    got = [u.prompt_logprobs for u in updates if u.request is requests[0]]
    assert len(got) == 1 and got[0] is entry
    assert all(len(r.output_token_ids) == 2 for r in requests)
