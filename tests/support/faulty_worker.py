"""A deliberately faulty worker, as an instrument: a real gRPC Worker service on loopback that
passes every call on to a real worker as bytes (metadata too: credentials, stream keys) and,
once armed, rewrites one Step reply's RunnerOutput, as a buggy or version-skewed worker would
send it."""
from __future__ import annotations

import threading
from concurrent import futures
from typing import Callable

import grpc

from engine_common.wire.codec import decode_runner_output, encode_runner_output
from engine_common.wire.diff import RunnerOutput
from engine_common.wire.protos import worker_pb2

_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
_DROPPED_HEADERS = ("user-agent", "grpc-")


class FaultyWorker:
    """Listens on 127.0.0.1 (`address`) in front of the worker at `upstream`. `arm(corrupt)`:
    the next Step reply that carries sampled tokens goes out as `corrupt(its RunnerOutput)`;
    `corrupted` is set once it went."""

    def __init__(self, upstream: str):
        self._channel = grpc.insecure_channel(upstream)
        self._corrupt: Callable[[RunnerOutput], RunnerOutput] | None = None
        self._lock = threading.Lock()
        self.corrupted = threading.Event()
        handlers = {m.name: self._handler(m) for m in _SERVICE.methods}
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self._server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers)])
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def arm(self, corrupt: Callable[[RunnerOutput], RunnerOutput]) -> None:
        with self._lock:
            self._corrupt = corrupt

    def close(self) -> None:
        self._server.stop(None)
        self._channel.close()

    def _handler(self, method) -> grpc.RpcMethodHandler:
        path = f"/{_SERVICE.full_name}/{method.name}"
        if method.client_streaming:
            call = self._channel.stream_stream(path)

            def step(requests, context):
                replies = call(requests, metadata=_metadata(context))
                context.add_callback(replies.cancel)
                try:
                    for reply in replies:
                        yield self._maybe_corrupt(reply)
                except grpc.RpcError as e:
                    context.abort(e.code(), e.details())
            return grpc.stream_stream_rpc_method_handler(step)
        call = self._channel.unary_unary(path)

        def unary(request, context):
            try:
                return call(request, metadata=_metadata(context), timeout=context.time_remaining())
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())
        return grpc.unary_unary_rpc_method_handler(unary)

    def _maybe_corrupt(self, raw: bytes) -> bytes:
        with self._lock:
            corrupt = self._corrupt
            if corrupt is None:
                return raw
            reply = worker_pb2.StepResponse.FromString(raw)
            if reply.HasField("error") or not reply.payload:
                return raw
            out = decode_runner_output(reply.payload)
            if not out.handles:
                return raw
            self._corrupt = None
        reply.payload = encode_runner_output(corrupt(out))
        self.corrupted.set()
        return reply.SerializeToString()


def _metadata(context) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in context.invocation_metadata() or ()
            if not k.startswith(_DROPPED_HEADERS)]
