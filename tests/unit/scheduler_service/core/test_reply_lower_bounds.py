"""Every id and handle of a worker's step reply has a lower bound too (reply_checks.py).

Only the vocabulary's upper bound was checked: a negative sampled, top-alternative or
prompt-logprob id passed, and a negative id indexes a Python vocabulary from its end (a wrong
token, silently). A negative handle named anywhere in the reply is no handle the scheduler gave
out. Each fails the step as BadReply naming the field, the value and the bound, and no request
changes. Over the wire the ids travel as uint32 (a negative id cannot be sent) but the maps'
handle keys as msgpack integers: a reply that does not decode is BadReply as well (it was an
engine bug, EngineFault, before)."""
from __future__ import annotations

import random

import msgpack
import pytest

from engine_common.configuration.config import SchedulerConfig
from engine_common.wire.codec import decode_scheduler_output, encode_runner_output
from engine_common.wire.diff import PromptLogprobs
from scheduler_service.core.reply_checks import BadReply
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.engine_core import EngineCore
from tests.support.scheduler_sim import SimWorker, make, make_request, step
from tests.unit.scheduler_service.core.test_reply_checks import VOCAB, _decoding, _refused


@pytest.mark.parametrize("field,match", [
    ("sampled_token_ids", r"sampled_token_ids\[1\]=-1 must be a token id in \[0, 599\] "
                          r"\(vocab_size\)"),
    ("handles", r"handles=-1 must be one of the 3 handles of the step's requests"),
])
def test_a_negative_sampled_id_or_handle_fails_the_step(field, match):
    sched, worker, requests = _decoding()

    def negative(reply):
        getattr(reply, field)[1] = -1
        return reply
    _refused(sched, worker, requests, negative, match)


def test_without_a_vocab_size_a_negative_id_still_fails_the_step():
    sched, worker = make()                      # vocab_size unknown: no upper bound
    requests = [make_request(f"r{i}", [3, 4, 5 + i], max_tokens=20) for i in range(2)]
    for r in requests:
        sched.add_request(r)
    step(sched, worker)

    def negative(reply):
        reply.sampled_token_ids[0] = -7
        return reply
    _refused(sched, worker, requests, negative, r"sampled_token_ids\[0\]=-7 must be a token "
             r"id >= 0")


@pytest.mark.parametrize("where", ["top", "prompt"])
def test_a_negative_top_alternative_or_prompt_logprob_id_fails_the_step(where):
    sched, worker, requests = _decoding()
    handle = requests[0].handle

    def negative(reply):
        if where == "top":
            reply.top_logprobs = {handle: ([5, -2], [-0.1, -2.0])}
        else:
            reply.prompt_logprobs = {handle: PromptLogprobs([0.0], [1], [-600], [0.0])}
        return reply
    field = r"top_logprobs\[\d+\]\[1\]=-2" if where == "top" else \
        r"prompt_logprobs\[\d+\]\.top_ids\[0\]=-600"
    _refused(sched, worker, requests, negative, field + r" must be a token id in \[0, 599\]")


def test_a_negative_handle_fails_the_step_wherever_the_reply_names_one():
    for name, corrupt in (("compiled_handles", lambda r: setattr(r, "compiled_handles", [-4])),
                          ("request_errors", lambda r: setattr(r, "request_errors", {-4: "x"})),
                          ("pooled", lambda r: setattr(r, "pooled", {-4: [0.5]}))):
        sched, worker, requests = _decoding()

        def negative(reply, corrupt=corrupt):
            corrupt(reply)
            return reply
        _refused(sched, worker, requests, negative,
                 rf"{name} \(a handle\)=-4 must be a handle \(>= 0\)")


class _NegativeKeyWorker:
    """Answers each step as SimWorker does, its reply's request_errors naming handle -1 (a
    msgpack map key: negative on the wire)."""

    def __init__(self):
        self.worker = SimWorker(16, 4)

    def execute(self, payload: bytes) -> bytes:
        out = self.worker.execute(decode_scheduler_output(payload))
        fields = msgpack.unpackb(encode_runner_output(out), raw=False)
        fields = fields[:5] + [b"", {-1: "a grammar failed"}]
        return msgpack.packb(fields, use_bin_type=True)


def test_a_reply_that_does_not_decode_is_a_bad_reply():
    config = SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                             max_model_len=64)
    core = EngineCore(Scheduler(config, 16, rng=random.Random(0), vocab_size=VOCAB),
                      _NegativeKeyWorker())
    request = make_request("a", [3, 4, 5], max_tokens=4)
    core.add_request(request)
    with pytest.raises(BadReply, match=r"reply to step 0 does not decode: malformed RunnerOutput "
                                       r"payload: request_errors key=-1: expected an integer "
                                       r">= 0") as refused:
        core.step()
    assert refused.value.kind == "protocol" and request.output_token_ids == []
