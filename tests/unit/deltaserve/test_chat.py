"""`deltaserve chat`'s session against a fake Generation stub: the history grows with each
answered turn, /reset clears it, a cancelled (Ctrl-C) or failed answer is dropped from it and
the chat goes on, and a model without a chat template is refused up front."""
from __future__ import annotations

import argparse
import io
import os
import signal

import grpc
import pytest

from deltaserve.chat import Session, build_parser, stream_answer
from engine_common.wire.protos import generation_pb2 as pb


class FakeCall:
    def __init__(self, pieces, interrupt_after=None, error=None):
        self.pieces, self.interrupt_after, self.error = pieces, interrupt_after, error
        self.cancelled = False

    def __iter__(self):
        for i, piece in enumerate(self.pieces):
            if i == self.interrupt_after:
                raise KeyboardInterrupt
            yield pb.GenerateResponse(text=piece)
        if self.error:
            raise self.error
        yield pb.GenerateResponse(finish_reason=pb.STOP_TOKEN)

    def cancel(self):
        self.cancelled = True


class SignalledCall(FakeCall):
    """A call that receives a real SIGINT after its first piece and, once cancelled, ends as
    grpc's iterator does: an RpcError with CANCELLED."""

    def __iter__(self):
        yield pb.GenerateResponse(text=self.pieces[0])
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:          # what grpc's own iterator must not have raised
            self.interrupted = True
            raise
        for piece in self.pieces[1:]:
            if self.cancelled:
                raise FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
            yield pb.GenerateResponse(text=piece)

    interrupted = False

    def cancel(self):
        was_active, self.cancelled = not self.cancelled, True
        return was_active


class FakeRpcError(grpc.RpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE, details="no worker ready"):
        self._code, self._details = code, details


    def code(self):
        return self._code

    def details(self):
        return self._details


class FakeStub:
    def __init__(self, calls, has_template=True):
        self.calls, self.requests, self.has_template = list(calls), [], has_template

    def Generate(self, req, timeout=None):
        self.requests.append(req)
        return self.calls.pop(0)

    def GetModelInfo(self, req, timeout=None):
        return pb.GetModelInfoResponse(model_name="m", has_chat_template=self.has_template)


def _args(*argv):
    return build_parser(argparse.ArgumentParser(), "localhost:1").parse_args(list(argv))


def _lines(*lines):
    """input() replacement: the given lines, then Ctrl-D."""
    it = iter(lines)

    def read(prompt):
        try:
            value = next(it)
        except StopIteration:
            raise EOFError from None
        if value is KeyboardInterrupt:
            raise KeyboardInterrupt
        return value
    return read


def _roles(req):
    return [(m.role, m.content) for m in req.messages]


def test_history_grows_and_reset_clears_it():
    stub = FakeStub([FakeCall(["Par", "is."]), FakeCall(["Yes."]), FakeCall(["Hi."])])
    out = io.StringIO()
    code = Session(stub, _args("--system", "Be brief.", "--max-tokens", "7"),
                   _lines("Capital of France?", "Sure?", "/reset", "Hello"), out).run()
    assert code == 0
    first, second, third = stub.requests
    assert _roles(first) == [("system", "Be brief."), ("user", "Capital of France?")]
    assert _roles(second) == [("system", "Be brief."), ("user", "Capital of France?"),
                              ("assistant", "Paris."), ("user", "Sure?")]
    assert _roles(third) == [("system", "Be brief."), ("user", "Hello")]
    assert first.stopping.max_tokens == 7 and not first.sampling.HasField("temperature")
    assert "Paris.\n" in out.getvalue() and "(history cleared)" in out.getvalue()


def test_ctrl_c_cancels_the_answer_but_not_the_chat():
    cancelled = FakeCall(["one ", "two ", "three"], interrupt_after=2)
    stub = FakeStub([cancelled, FakeCall(["ok"])])
    out = io.StringIO()
    assert Session(stub, _args(), _lines("count", KeyboardInterrupt, "again"), out).run() == 0
    assert cancelled.cancelled
    assert "one two \n(answer cancelled; the question is not kept)" in out.getvalue()
    assert "(/exit or Ctrl-D leaves the chat)" in out.getvalue()
    assert _roles(stub.requests[1]) == [("user", "again")]      # the cancelled turn is gone


def test_a_failed_answer_is_reported_and_dropped():
    stub = FakeStub([FakeCall(["partial"], error=FakeRpcError()), FakeCall(["fine"])])
    out = io.StringIO()
    assert Session(stub, _args(), _lines("a", "b", "/exit", "never read"), out).run() == 0
    assert "error: UNAVAILABLE: no worker ready" in out.getvalue()
    assert _roles(stub.requests[1]) == [("user", "b")]
    assert len(stub.requests) == 2


def test_a_model_without_a_chat_template_is_refused(capsys):
    stub = FakeStub([], has_template=False)
    assert Session(stub, _args(), _lines("hi"), io.StringIO()).run() == 1
    assert "m has no chat template" in capsys.readouterr().err
    assert stub.requests == []


def test_stream_answer_collects_the_text():
    out = io.StringIO()
    answer = stream_answer(FakeStub([FakeCall(["a", "b"])]), pb.GenerateRequest(), out)
    assert (answer.text, answer.cancelled, answer.error) == ("ab", False, None)
    assert answer.finish_reason == pb.STOP_TOKEN and out.getvalue() == "ab"


@pytest.mark.parametrize("argv, question", [(["What?"], "What?"), ([], None)])
def test_one_shot_or_interactive(argv, question):
    assert _args(*argv).question == question


def test_a_real_sigint_cancels_the_call_through_the_handler_and_is_restored():
    before = signal.getsignal(signal.SIGINT)
    call = SignalledCall(["one ", "two ", "three"])
    stub = FakeStub([call, FakeCall(["ok"])])
    out = io.StringIO()
    assert Session(stub, _args(), _lines("count", "again"), out).run() == 0
    assert call.cancelled and not call.interrupted
    assert "one \n(answer cancelled; the question is not kept)" in out.getvalue()
    assert "error:" not in out.getvalue()
    assert _roles(stub.requests[1]) == [("user", "again")]      # the cancelled turn is gone
    assert signal.getsignal(signal.SIGINT) is before


def test_a_history_too_long_for_the_model_says_how_to_go_on():
    too_long = FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "request 'r' rejected: prompt "
                            "tokens + max_tokens=9000 must be <= max_model_len (8192)")
    stub = FakeStub([FakeCall(["Paris."]), FakeCall([], error=too_long), FakeCall(["ok"])])
    out = io.StringIO()
    assert Session(stub, _args(), _lines("a", "b", "/reset", "c"), out).run() == 0
    assert ("max_model_len (8192)\n(the conversation no longer fits the model: /reset clears "
            "the history)") in out.getvalue()
    assert _roles(stub.requests[2]) == [("user", "c")]
