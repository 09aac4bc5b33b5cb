"""WorkerClient's step deadline over fake streams: a late step whose worker answers Health gets
more time (a busy machine), one whose worker does not (frozen, unreachable) fails at once, and
no step waits more than MAX_SLOW_PERIODS step timeouts."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import worker_pb2
from scheduler_service.workers.worker_client import MAX_SLOW_PERIODS, WorkerClient
from scheduler_service.workers.worker_stream import StepLate


class LateStream:
    """Late `lates` times, then the reply."""

    def __init__(self, lates: int):
        self.lates = lates
        self.receives = 0

    def receive(self, epoch, step, deadline):
        self.receives += 1
        if self.receives <= self.lates:
            raise StepLate(f"worker w: no reply to step {step} in time (step timeout)")
        return worker_pb2.StepResponse(epoch=epoch, step=step, payload=b"tokens")

    def close(self):
        pass


class Stub:
    def __init__(self, answers: bool):
        self.answers = answers
        self.health_calls = 0

    def Health(self, request, timeout):
        self.health_calls += 1
        if not self.answers:
            raise _Timeout()
        return worker_pb2.HealthResponse(ready=True)


class _Timeout(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


def _client(stream: LateStream, stub: Stub) -> WorkerClient:
    client = WorkerClient(["127.0.0.1:1"], connect_timeout_s=0.01, step_timeout_s=0.01)
    client._stubs, client._streams = [stub], [stream]
    client.epoch, client._failure, client._next_step = 7, None, 1
    return client


def test_a_late_step_of_a_worker_that_answers_gets_more_time():
    stream, stub = LateStream(lates=3), Stub(answers=True)
    assert _client(stream, stub).collect(0) == b"tokens"
    assert stub.health_calls == 3 and stream.receives == 4


def test_a_late_step_of_a_worker_that_does_not_answer_fails_at_once():
    stream, stub = LateStream(lates=3), Stub(answers=False)
    with pytest.raises(StepLate, match="no reply to step 0 in time .*does not answer Health "
                                       r"\(DEADLINE_EXCEEDED"):
        _client(stream, stub).collect(0)
    assert stub.health_calls == 1 and stream.receives == 1


def test_no_step_waits_for_ever():
    stream, stub = LateStream(lates=10**6), Stub(answers=True)
    with pytest.raises(StepLate):
        _client(stream, stub).collect(0)
    assert stream.receives == MAX_SLOW_PERIODS
