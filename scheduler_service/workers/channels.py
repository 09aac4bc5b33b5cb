"""Channels to the worker services, carrying this scheduler's credential on every call.

With a token (--worker-token-file) every call gets the metadata `authorization: Bearer <token>`
(a client interceptor, so Init, Step, Reset, Health and Info all carry it); with TLS
(--worker-tls-*) the channel verifies the worker's certificate against the CA and presents the
scheduler's own certificate. The worker's address must match a name in its certificate.
"""
from __future__ import annotations

import grpc

from engine_common.security.grpc_metadata import with_metadata
from engine_common.security.tls import channel_credentials
from engine_common.security.worker_auth import WorkerAuth

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


def worker_channel(address: str, auth: WorkerAuth = WorkerAuth(),
                   options: tuple = CHANNEL_OPTIONS) -> grpc.Channel:
    """A channel to the worker at `address` that carries `auth` (nothing when it is empty)."""
    if auth.tls:
        channel = grpc.secure_channel(address, channel_credentials(auth.ca, auth.cert, auth.key),
                                      options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    return with_metadata(channel, auth.metadata())
