"""StepStream against a real gRPC server on loopback: replies come back in order, a stream the
worker ends with an error fails `receive` with the status text, and `close` ends the reader and
lets go of the call object at once. That last point keeps processes from hanging at exit: a
call left for the interpreter's exit runs its finalizer while daemon threads are frozen, and
grpc's finalizer takes a lock one of them may hold."""
from __future__ import annotations

import gc
import time
import weakref
from concurrent import futures

import grpc
import pytest

from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from scheduler_service.errors import WorkerFailure
from scheduler_service.workers.worker_stream import StepStream


class EchoWorker(worker_pb2_grpc.WorkerServicer):
    """Answers each step with its (epoch, step); aborts on step `fail_at`."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at

    def Step(self, request_iterator, context):
        for request in request_iterator:
            if request.step == self.fail_at:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no step {request.step}")
            yield worker_pb2.StepResponse(epoch=request.epoch, step=request.step)


@pytest.fixture
def stub_for():
    servers, channels = [], []

    def start(worker: EchoWorker):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        servers.append(server)
        channels.append(channel)
        return worker_pb2_grpc.WorkerStub(channel), f"127.0.0.1:{port}"

    gc_was_enabled = gc.isenabled()
    gc.disable()  # the call must be freed by reference counting, not by a later collection
    yield start
    if gc_was_enabled:
        gc.enable()
    for channel in channels:
        channel.close()
    for server in servers:
        server.stop(None)


def _send(stream: StepStream, step: int) -> None:
    stream.send(worker_pb2.StepRequest(epoch=3, step=step))


def _far() -> float:
    return time.monotonic() + 60


def test_replies_arrive_in_order_and_close_frees_the_call(stub_for):
    stream = StepStream(*stub_for(EchoWorker()))
    for step in range(3):
        _send(stream, step)
    assert [stream.receive(3, s, _far()).step for s in range(3)] == [0, 1, 2]
    call = weakref.ref(stream._call)
    stream.close()
    assert not stream._reader.is_alive()
    assert call() is None
    stream.close()  # idempotent


def test_an_aborted_stream_names_the_status_and_close_still_frees_the_call(stub_for):
    stream = StepStream(*stub_for(EchoWorker(fail_at=1)))
    _send(stream, 0)
    _send(stream, 1)
    assert stream.receive(3, 0, _far()).step == 0
    with pytest.raises(WorkerFailure, match="FAILED_PRECONDITION: no step 1"):
        stream.receive(3, 1, _far())
    with pytest.raises(WorkerFailure, match="FAILED_PRECONDITION"):  # every later receive too
        stream.receive(3, 2, _far())
    call = weakref.ref(stream._call)
    stream.close()
    assert call() is None


class InternalFault(worker_pb2_grpc.WorkerServicer):
    """Fails its first step as the worker's servicer does when the runner raised: an INTERNAL
    StepError, then the call aborted INTERNAL, both with the exception's text."""

    def __init__(self, text: str):
        self.text = text

    def Step(self, request_iterator, context):
        for request in request_iterator:
            yield worker_pb2.StepResponse(epoch=request.epoch, step=request.step,
                                          error=worker_pb2.StepError(
                                              code=worker_pb2.StepError.INTERNAL,
                                              message=self.text))
            context.abort(grpc.StatusCode.INTERNAL, self.text)


def test_an_internal_step_error_names_its_code_only_and_logs_its_text(stub_for, caplog):
    """Its text is the runner's exception, which may quote one request; a failure's message
    reaches every tenant's stream, and a peer node's stream quotes how this one ended."""
    secret = "RuntimeError: bad row for prompt 'tenant-b: the password is hunter2'"
    peers: list = []
    healthy = StepStream(*stub_for(EchoWorker()), peers=peers)
    failing = StepStream(*stub_for(InternalFault(secret)), peers=peers)
    _send(failing, 0)
    with pytest.raises(WorkerFailure) as raised:
        failing.receive(3, 0, _far())
    assert "step 0 failed: INTERNAL (the worker's runner failed" in str(raised.value)
    assert raised.value.kind == "internal"
    with pytest.raises(WorkerFailure) as ended:      # how the stream ended, after it
        failing.receive(3, 1, _far())
    assert "INTERNAL after StepError INTERNAL" in str(ended.value), ended.value
    with pytest.raises(WorkerFailure) as peer:       # the other node's stream hears of it
        healthy.receive(3, 0, _far())
    assert "INTERNAL after StepError INTERNAL" in str(peer.value), peer.value
    for error in (raised.value, ended.value, peer.value):
        assert "hunter2" not in str(error), error
    assert [r.getMessage() for r in caplog.records if "hunter2" in r.getMessage()], \
        "the scheduler's log lost the worker's text"
    healthy.close()
    failing.close()
