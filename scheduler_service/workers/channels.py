"""Channels to the worker services, carrying this scheduler's credential on every call.

With a token (--worker-token-file) every call gets the metadata `authorization: Bearer <token>`
(a client interceptor, so Init, Step, Reset, Health and Info all carry it); with TLS
(--worker-tls-*) the channel verifies the worker's certificate against the CA and presents the
scheduler's own certificate. The worker's address must match a name in its certificate.
"""
from __future__ import annotations

from typing import NamedTuple

import grpc

from engine_common.tls import channel_credentials
from engine_common.worker_auth import WorkerAuth

# Large payloads (whole prompts), keepalive pings every few seconds so a dead link is noticed,
# and quick reconnects so a restarted worker is found again within a second or two.
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: tuple | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: object | None


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata to every call."""

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


def worker_channel(address: str, auth: WorkerAuth = WorkerAuth(),
                   options: tuple = CHANNEL_OPTIONS) -> grpc.Channel:
    """A channel to the worker at `address` that carries `auth` (nothing when it is empty)."""
    if auth.tls:
        channel = grpc.secure_channel(address, channel_credentials(auth.ca, auth.cert, auth.key),
                                      options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if auth.token:
        channel = grpc.intercept_channel(channel, _AddMetadata(auth.metadata()))
    return channel
