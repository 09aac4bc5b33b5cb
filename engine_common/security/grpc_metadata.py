"""A channel that adds fixed metadata to every call (a credential: the worker token, an API key),
for clients on both sides. grpc's own call credentials need a TLS channel; this works on any.
And, for servers' interceptors, a handler that replaces a method's behaviour keeping its shape."""
from __future__ import annotations

from typing import NamedTuple

import grpc


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: tuple | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: object | None


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self._metadata = metadata

    def _details(self, d) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, tuple(d.metadata or ()) + self._metadata,
                            d.credentials, d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def with_metadata(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> grpc.Channel:
    """`channel` adding `metadata` to every call (the channel itself when it is empty)."""
    return grpc.intercept_channel(channel, _AddMetadata(metadata)) if metadata else channel


def same_shape_handler(handler: grpc.RpcMethodHandler, behaviour) -> grpc.RpcMethodHandler:
    """A handler running `behaviour(request_or_iterator, context)` with `handler`'s streaming
    shape (an interceptor's refusal must be served as the method the client called)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour)
    return grpc.unary_unary_rpc_method_handler(behaviour)
