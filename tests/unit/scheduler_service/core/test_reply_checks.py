"""A worker's step reply is checked before any of it is applied (reply_checks.py): a handle sent
twice, an id outside the vocabulary, a payload of another step, a handle not of the step, a run
of tokens longer than the drafts allow, each fails the step as BadReply (a WorkerFailure of kind
"protocol") naming the field, the value and what it must be, and no request changed. Before, the
repeated handle appended a second token and the out-of-vocabulary id went to the client."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine_common.wire.diff import PromptLogprobs
from scheduler_service.core.reply_checks import BadReply
from scheduler_service.errors import WorkerFailure
from tests.support.scheduler_sim import make, make_request, run_steps, step
from tests.support.spec_sim import SpecSimWorker, periodic_sample

VOCAB = 600          # the simulated worker samples ids in [100, 600)


def _decoding(n: int = 3, **cfg):
    """A scheduler with n requests past their prefill, its worker, the requests."""
    sched, worker = make(vocab_size=VOCAB, **cfg)
    requests = [make_request(f"r{i}", [3, 4, 5 + i], max_tokens=20) for i in range(n)]
    for r in requests:
        sched.add_request(r)
    step(sched, worker)
    return sched, worker, requests


def _refused(sched, worker, requests, corrupt, match: str) -> BadReply:
    """The next step's reply, corrupted, is refused and leaves every request as it was."""
    before = [list(r.output_token_ids) for r in requests]
    out = sched.schedule()
    reply = worker.execute(out)
    with pytest.raises(BadReply, match=match) as refused:
        sched.update_from_output(out, corrupt(reply))
    assert [r.output_token_ids for r in requests] == before
    assert isinstance(refused.value, WorkerFailure) and refused.value.kind == "protocol"
    return refused.value


def test_a_handle_sent_twice_fails_the_step_and_adds_no_token():
    sched, worker, requests = _decoding()

    def twice(reply):
        reply.handles.append(reply.handles[0])
        reply.sampled_token_ids.append(reply.sampled_token_ids[0])
        reply.logprobs.append(0.0)
        return reply
    _refused(sched, worker, requests, twice,
             r"reply to step 1 is invalid: handles\[3\]=\d+ must be a handle not sent before")


def test_an_id_outside_the_vocabulary_fails_the_step():
    sched, worker, requests = _decoding()

    def out_of_vocab(reply):
        reply.sampled_token_ids[1] = VOCAB
        return reply
    _refused(sched, worker, requests, out_of_vocab,
             r"sampled_token_ids\[1\]=600 must be a token id in \[0, 599\] \(vocab_size\)")


def test_a_top_alternative_or_prompt_id_outside_the_vocabulary_fails_the_step():
    sched, worker, requests = _decoding()
    handle = requests[0].handle

    def bad_top(reply):
        reply.top_logprobs = {handle: ([5, VOCAB + 7], [-0.1, -2.0])}
        return reply
    _refused(sched, worker, requests, bad_top, r"top_logprobs\[\d+\]\[1\]=607 must be a token")
    sched, worker, requests = _decoding()
    handle = requests[0].handle

    def bad_prompt(reply):
        reply.prompt_logprobs = {handle: PromptLogprobs([0.0], [1], [VOCAB], [0.0])}
        return reply
    _refused(sched, worker, requests, bad_prompt, r"prompt_logprobs\[\d+\]\.top_ids\[0\]=600")


def test_a_payload_of_another_step_fails_the_step():
    sched, worker, requests = _decoding()
    _refused(sched, worker, requests, lambda reply: dataclasses.replace(reply, step=7),
             r"reply to step 1 is invalid: step=7 must be 1: the step it answers")


def test_a_token_for_a_handle_not_of_the_step_fails_it():
    sched, worker, requests = _decoding()
    stranger = 1 + max(r.handle for r in requests)

    def foreign(reply):
        reply.handles[0] = stranger
        return reply
    _refused(sched, worker, requests, foreign,
             rf"handles={stranger} must be one of the 3 handles of the step's requests")


def test_with_drafts_a_run_longer_than_the_tokens_scheduled_fails_the_step():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1})
    sample = periodic_sample(3)
    sched, _ = make(vocab_size=VOCAB, sample_fn=sample, speculative_config=spec)
    worker = SpecSimWorker(64, sched.config.block_size, sample_fn=sample)
    request = make_request("a", [11, 12, 13, 11, 12, 13], max_tokens=30)
    sched.add_request(request)
    for _ in range(2):
        step(sched, worker)

    def longer(reply):     # its run 3 tokens longer: past its 2 drafts + 1 whatever it made
        reply.handles += [request.handle] * 3
        reply.sampled_token_ids += [reply.sampled_token_ids[-1]] * 3
        reply.logprobs += [0.0] * 3
        return reply
    _refused(sched, worker, [request], longer,
             r"handles \(handle \d+\)='[4-6] tokens' must be at most [1-3]: the tokens sched")


def test_with_drafts_a_handle_in_two_runs_fails_the_step():
    sched, worker, requests = _decoding(speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 2}))

    def split(reply):
        reply.handles.append(reply.handles[0])
        reply.sampled_token_ids.append(reply.sampled_token_ids[0])
        reply.logprobs.append(0.0)
        return reply
    _refused(sched, worker, requests, split, r"handles\[3\]=\d+ must be a handle not sent before "
             r"in this reply \(a request's tokens come in one run\)")


def test_valid_replies_pass():
    sched, worker, requests = _decoding(n=4)
    run_steps(sched, worker)
    assert all(len(r.output_token_ids) == 20 for r in requests)
