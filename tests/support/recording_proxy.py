"""A pass-through gRPC server that records what a client sends: in front of a real replica, it
shows what the gateway puts in each call (metadata, request bytes) without changing anything.
Every VllmEngine and grpc.health.v1 method is relayed as bytes; a call to any other service is
recorded and left UNIMPLEMENTED (the gateway probes other engines' services to detect ours)."""
from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from engine_common.wire.protos import vllm_engine_pb2

_SERVICES = {d.full_name: d for d in (vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
                                      health_pb2.DESCRIPTOR.services_by_name["Health"])}
_NOT_FORWARDED = ("user-agent", "grpc-")


@dataclass
class Call:
    method: str                 # /package.Service/Method
    metadata: tuple             # (key, value) pairs as the server received them
    request: bytes | None       # a unary request's bytes (None for a client stream)


class RecordingProxy(grpc.GenericRpcHandler):
    """Listens on 127.0.0.1 (`address`) in front of `upstream` (HOST:PORT); `calls` grows."""

    def __init__(self, upstream: str):
        self._channel = grpc.insecure_channel(upstream)
        self._lock = threading.Lock()
        self.calls: list[Call] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        self._server.add_generic_rpc_handlers([self])
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(None)
        self._channel.close()

    def service(self, details):
        service_name, name = details.method[1:].rsplit("/", 1)
        metadata = tuple(details.invocation_metadata)
        method = _SERVICES.get(service_name, None)
        if method is None:
            self._record(Call(details.method, metadata, None))
            return None
        method = method.methods_by_name[name]
        path = details.method
        if method.client_streaming:     # only the KV-event and health streams are not unary
            return grpc.stream_stream_rpc_method_handler(
                lambda requests, context: self._relay(
                    self._channel.stream_stream(path)(requests, metadata=_forward(context)),
                    context, Call(path, metadata, None)))
        if method.server_streaming:
            return grpc.unary_stream_rpc_method_handler(
                lambda request, context: self._relay(
                    self._channel.unary_stream(path)(request, metadata=_forward(context)),
                    context, Call(path, metadata, request)))

        def unary(request, context):
            self._record(Call(path, metadata, request))
            try:
                return self._channel.unary_unary(path)(request, metadata=_forward(context))
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())
        return grpc.unary_unary_rpc_method_handler(unary)

    def _relay(self, call, context, record: Call):
        """A stream's replies, its headers at once (smg gives a KV-event stream 2 s for them)
        and the upstream call cancelled when the client goes."""
        self._record(record)
        context.add_callback(call.cancel)
        context.send_initial_metadata(())
        try:
            yield from call
        except grpc.RpcError as e:
            context.abort(e.code(), e.details())

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)


def _forward(context) -> list:
    return [(k, v) for k, v in context.invocation_metadata() or ()
            if not k.startswith(_NOT_FORWARDED)]
