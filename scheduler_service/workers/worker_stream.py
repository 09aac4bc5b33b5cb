"""One worker's Step stream on grpc's synchronous API. Torch-free.

grpc drives a client-side bidi stream from a request iterator and hands back a blocking response
iterator. Here the request iterator is a generator fed by a queue (`send`), and a daemon thread
moves responses, or the stream's end, into a second queue, so `receive` can wait with a deadline:
a killed worker ends the stream (UNAVAILABLE) and `receive` raises at once; a stuck one raises
when the deadline passes. Neither ever hangs the caller.

With several nodes the streams of one epoch share a list of peers: when one ends, a
`PeerEnded` marker goes into every other's replies, so a step waiting for node 0 (whose ranks
may wait for ever in a collective for a dead peer) fails as soon as node 1's stream ends, not
after node 0's step timeout.

A StepError with code SYMMETRY_DIVERGENCE (a node's ranks disagreed) raises SymmetryError;
STALE_EPOCH (another scheduler took the worker over) raises Fenced; any other error,
WorkerFailure. The failure's message reaches every open stream, every tenant's: an INTERNAL
StepError's text is the runner's exception, which may carry one request's data, so only its
code goes into the failure (and into how the stream ended); its text goes to this log.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from engine_common.security.stream_key import stream_key_metadata
from engine_common.wire.protos import worker_pb2
from scheduler_service.errors import Fenced, WorkerFailure

log = logging.getLogger(__name__)

_STOP = object()  # the request generator's end marker
_READER_JOIN_S = 10.0  # a cancelled call ends its response iterator at once; this only bounds it


class StepLate(WorkerFailure):
    """No reply by the deadline (the worker client then asks the worker whether it still
    answers at all)."""

    default_kind = "step_timeout"


class SymmetryError(WorkerFailure):
    """Ranks that must be identical disagree on their sampled ids or cached state
    (verify_symmetry): within a node (the worker reports it) or across nodes (the client
    compares the nodes' digests). Like any WorkerFailure it ends the epoch."""

    default_kind = "symmetry_divergence"


def describe_rpc_error(e: grpc.RpcError) -> str:
    """"CODE: details" for an RpcError from a call (or its repr for anything else)."""
    code = getattr(e, "code", None)
    if callable(code):
        return f"{code().name}: {e.details()}"
    return repr(e)


_STEP_ERRORS = {worker_pb2.StepError.SYMMETRY_DIVERGENCE: SymmetryError,
                worker_pb2.StepError.STALE_EPOCH: Fenced}


def step_error_text(error: worker_pb2.StepError) -> str:
    """What every stream may hear of a StepError: "CODE: message", or for INTERNAL (the
    runner raised: a model, device or grammar bug, whose text is the exception's own and may
    quote any request) the code alone. The other codes' texts name fields, handles, counts and
    out-of-range values (batch/diff_check.py, wire/codec.py), never a prompt or a request id."""
    code = worker_pb2.StepError.Code.Name(error.code)
    if error.code == worker_pb2.StepError.INTERNAL:
        return (f"{code} (the worker's runner failed; its message is in the worker's and the "
                "scheduler's logs only: it may quote a request)")
    return f"{code}: {error.message}"


class _Ended:
    """The response iterator stopped. Holds the reason as text, not the RpcError: grpc's error
    is the call object itself, which must not outlive close()."""

    def __init__(self, why: str):
        self.why = why


class _PeerEnded:
    """Another node's stream of the same epoch ended (the step cannot complete)."""

    def __init__(self, peer: "StepStream", why: str):
        self.peer, self.why = peer, why


class PeerEnded(WorkerFailure):
    """Raised by `receive` when a peer stream ended first; `peer` is that StepStream (its own
    receive names the cause)."""

    default_kind = "stream_ended"

    def __init__(self, message: str, peer: "StepStream"):
        super().__init__(message)
        self.peer = peer


class StepStream:
    """A Step stream to the worker at `address`; replies are awaited in send order."""

    def __init__(self, stub, address: str, peers: list | None = None, key: bytes = b""):
        """`peers`: the epoch's streams, one per node, shared by them; this one adds itself.
        `key`: the epoch's stream key from the worker's Init or Reset (stream_key.py)."""
        self.address = address
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._peers: list[StepStream] = [] if peers is None else peers
        self._peers.append(self)
        self._call = stub.Step(self._requests(), metadata=stream_key_metadata(key))
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"step-reader-{address}")
        self._reader.start()

    def send(self, request: worker_pb2.StepRequest) -> None:
        self._outbox.put(request)

    def receive(self, epoch: int, step: int, deadline: float) -> worker_pb2.StepResponse:
        """The reply to (epoch, step); deadline is a time.monotonic() value."""
        try:
            item = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise StepLate(f"worker {self.address}: no reply to step {step} in time "
                           "(step timeout)") from None
        if isinstance(item, _Ended):
            self._inbox.put(item)  # every later receive fails the same way
            raise WorkerFailure(f"worker {self.address}: Step stream ended at step {step}: "
                                f"{item.why}", kind="stream_ended")
        if isinstance(item, _PeerEnded):
            self._inbox.put(item)
            raise PeerEnded(f"worker {item.peer.address}: Step stream ended before step {step} "
                            f"completed: {item.why}", item.peer)
        if item.HasField("error"):
            code = worker_pb2.StepError.Code.Name(item.error.code)
            error = _STEP_ERRORS.get(item.error.code, WorkerFailure)
            raise error(f"worker {self.address}: step {step} failed: "
                        f"{step_error_text(item.error)}", kind=code.lower())
        if item.epoch != epoch or item.step != step:
            raise WorkerFailure(f"worker {self.address}: expected the reply to epoch {epoch} "
                                f"step {step}, got epoch {item.epoch} step {item.step}",
                                kind="protocol")
        return item

    def close(self) -> None:
        """End the request stream, cancel the call and wait for the reader (idempotent).

        The call object must die here, on a live interpreter: left to the interpreter's exit,
        its finalizer takes the call's lock, which a daemon thread frozen at exit may hold,
        and the process never ends."""
        if self._call is None:
            return
        self._outbox.put(_STOP)
        self._call.cancel()
        self._reader.join(timeout=_READER_JOIN_S)
        if not self._reader.is_alive():
            self._call = None

    def _requests(self):
        while (item := self._outbox.get()) is not _STOP:
            yield item

    def _read(self) -> None:
        call, error = self._call, None
        try:
            for response in call:
                if response.HasField("error"):
                    error = response.error
                    if error.code == worker_pb2.StepError.INTERNAL:   # its text: here only
                        log.error("worker %s: step %d failed: INTERNAL: %s", self.address,
                                  response.step, error.message)
                self._inbox.put(response)
            why = "the worker closed it"
        except grpc.RpcError as e:
            # After a StepError the worker aborts the call with the same text: its redacted
            # form, not the status's details (a peer's PeerEnded quotes it to every stream).
            why = (describe_rpc_error(e) if error is None else
                   f"{describe_rpc_error(e).split(':')[0]} after StepError "
                   f"{step_error_text(error)}")
            e.__traceback__ = None  # the error is the call: its traceback's frames hold it
        self._inbox.put(_Ended(why))
        for peer in list(self._peers):
            if peer is not self:
                peer._inbox.put(_PeerEnded(self, why))
