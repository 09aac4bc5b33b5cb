"""A caller without the worker's token holds none of the worker's threads with unary calls whose
request message it never sends. grpc serves a unary request by waiting, on one of the worker's 8
pooled threads, for its message: 8 such calls to any method (the refused Worker RPCs, health
Watch, the open health Check) left the scheduler's Health calls queued behind them. A real worker
service on loopback, with a token and no model."""
from __future__ import annotations

import threading

import grpc
import pytest

from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from tests.support.grpc_harness import bearer, health_status
from tests.support.inproc_worker import cpu_worker
from worker_service.service import open_check

TOKEN = "test-token-0123456789abcdef"
REFUSED = ("/deltaserve.v1.Worker/Init", "/deltaserve.v1.Worker/Reset",
           "/deltaserve.v1.Worker/Health", "/deltaserve.v1.Worker/Info")
WATCH = "/grpc.health.v1.Health/Watch"      # a unary request, a response stream
CHECK = "/grpc.health.v1.Health/Check"      # open to every caller (probes)
PER_METHOD = 8                              # the worker's pool threads


@pytest.fixture
def worker_address(monkeypatch):
    # an open check waits 0.2 s for its message here, not 2 s: what is checked is that the
    # wait ends (before the fix nothing ended it), not how long it is
    monkeypatch.setattr(open_check, "OPEN_CHECK_WAIT_S", 0.2)
    with cpu_worker(TOKEN) as address:
        yield address


class Withheld:
    """Calls whose request stream sends nothing until `close`: to a unary method, a call whose
    request message does not come."""

    def __init__(self, channel: grpc.Channel):
        self._channel = channel
        self._release = threading.Event()
        self._calls = []

    def _nothing(self):
        self._release.wait()
        yield from ()

    def open(self, method: str):
        """A unary-response call (a future)."""
        call = self._channel.stream_unary(method).future(self._nothing(), timeout=60)
        self._calls.append(call)
        return call

    def open_stream(self, method: str):
        """A response-streaming call (its response iterator)."""
        call = self._channel.stream_stream(method)(self._nothing(), timeout=60)
        self._calls.append(call)
        return call

    def close(self) -> None:
        self._release.set()
        for call in self._calls:
            call.cancel()


def _code(future) -> str:
    return future.exception(timeout=30).code().name


def _stream_code(call) -> str:
    try:
        next(call)
    except grpc.RpcError as e:
        return e.code().name
    return "answered"


def test_withheld_request_messages_hold_no_worker_thread(worker_address):
    with grpc.insecure_channel(worker_address) as channel:
        held = Withheld(channel)
        try:
            refused = [held.open(m) for m in REFUSED for _ in range(PER_METHOD)]
            watches = [held.open_stream(WATCH) for _ in range(PER_METHOD)]
            checks = [held.open(CHECK) for _ in range(PER_METHOD)]
            # The scheduler's own call, on the same connection, after all of them.
            reply = worker_pb2_grpc.WorkerStub(channel).Health(
                worker_pb2.HealthRequest(), timeout=10, metadata=bearer(TOKEN))
            assert (reply.ready, reply.reason) == (False, "not initialized")
            assert {_code(c) for c in refused} == {"UNAUTHENTICATED"}
            assert {_stream_code(c) for c in watches} == {"UNAUTHENTICATED"}
            # A few checks wait for their message, then are cancelled; the rest are refused
            # at once. None is left waiting.
            assert {_code(c) for c in checks} <= {"CANCELLED", "RESOURCE_EXHAUSTED"}
        finally:
            held.close()
    assert health_status(worker_address, "", timeout=10) == "SERVING"   # probes still answered
