"""Which client certificates may drive this worker: --worker-tls-allowed-clients.

TLS alone admits any certificate the worker's CA signed, and a cluster's CA signs the workers'
own serving certificates too: one worker (or whoever holds its key) could Init, Reset or Step
another. `ClientNameCheck` refuses PERMISSION_DENIED a call whose peer certificate carries none of
the allowed names (a DNS or URI subjectAltName, or the subject's common name, compared exactly)
before its handler runs: no state is touched and a Step stream is never opened. The refusal
names what the certificate presented, escaped and clipped (a common name may hold a newline).

A server interceptor sees no peer, so the check runs in the handler, and each checked handler is
served with a request stream: the check comes before any request message is read (a unary
handler would hold a pool thread until a refused caller sent it; open_check.py). For the same
reason, without a token check in front (which guards them itself), the open methods (health
`Check`) are served to a refused certificate as to a caller without the token: bounded threads
and waits (OpenChecks); otherwise eight withheld checks from another worker's certificate held
every pool thread and the scheduler's calls waited behind them.
"""
from __future__ import annotations

import logging
from typing import Iterable

import grpc

from engine_common.request.params import clip
from worker_service.failures import FailureKind
from worker_service.service.log_limit import LogLimit
from worker_service.service.open_check import OpenChecks, one_message
from worker_service.service.servicer import FAILURES

log = logging.getLogger(__name__)

# gRPC's auth context keys of the names a certificate may be allowed by, with their labels.
NAME_KEYS = (("x509_common_name", "CN"), ("peer_dns", "DNS"), ("peer_uri", "URI"))
# What a refusal quotes of the presented names: this many, each clipped to this many characters.
MAX_QUOTED_NAMES = 6
MAX_NAME_CHARS = 80


def presented_names(auth_context: dict[str, list[bytes]]) -> list[tuple[str, str]]:
    """(label, name) of each name the peer's certificate carries that may allow it."""
    return [(label, value.decode("utf-8", "replace"))
            for key, label in NAME_KEYS for value in auth_context.get(key, ())]


def describe_names(names: list[tuple[str, str]]) -> str:
    """The names for a message or a log line: each escaped (ascii(): no newline or control
    character survives) and clipped, at most MAX_QUOTED_NAMES of them."""
    if not names:
        return "no name"
    shown = [f"{label} {clip(ascii(name), MAX_NAME_CHARS)}"
             for label, name in names[:MAX_QUOTED_NAMES]]
    more = len(names) - MAX_QUOTED_NAMES
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


class ClientNameCheck(grpc.ServerInterceptor):
    """Refuses every call (but `open_methods`) whose peer certificate has no allowed name."""

    def __init__(self, allowed: Iterable[str], open_methods: frozenset[str] = frozenset(),
                 log_limit: LogLimit | None = None, open_checks: OpenChecks | None = None):
        """open_checks: serve the open (unary) methods to a refused peer through it; None
        leaves them as they are (a token check in front already guards them)."""
        self.allowed = frozenset(allowed)
        self.open_methods = open_methods
        # Refusals are logged at most once per 10 s: a refused peer repeats them at will.
        self._log_limit = log_limit or LogLimit(10.0)
        self._open_checks = open_checks

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler_call_details.method in self.open_methods:
            return handler if self._open_checks is None else self._open(handler)
        return self._checked(handler, handler_call_details.method)

    def allows(self, context: grpc.ServicerContext) -> bool:
        """Whether the peer's certificate carries an allowed name."""
        return any(name in self.allowed for _, name in presented_names(context.auth_context()))

    def refusal(self, context: grpc.ServicerContext, method: str) -> str | None:
        """The refusal's message when the peer may not call; None when it may."""
        if self.allows(context):
            return None
        names = presented_names(context.auth_context())
        shown = describe_names(names)
        skipped = self._log_limit.take()
        if skipped is not None:
            log.warning("refused %s: a client certificate with %s, none in "
                        "--worker-tls-allowed-clients (and %d other refused calls since the "
                        "last such line)", method, shown, skipped)
        return (f"client certificate not allowed: it carries {shown}, none of them in this "
                "worker's --worker-tls-allowed-clients")

    def _open(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """A unary open method: as it is for an allowed peer, behind OpenChecks for others."""
        guarded = self._open_checks.guard(handler).stream_unary

        def serve(requests, context):
            if not self.allows(context):
                return guarded(requests, context)
            return handler.unary_unary(one_message(requests, context, "a health check"),
                                       context)

        return grpc.stream_unary_rpc_method_handler(serve, handler.request_deserializer,
                                                    handler.response_serializer)

    def _checked(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """`handler` behind the check, served with a request stream (whatever its shape)."""
        status = FAILURES[FailureKind.NOT_ALLOWED][1]
        inner = (handler.stream_stream or handler.stream_unary or handler.unary_stream
                 or handler.unary_unary)

        def serve(requests, context):
            message = self.refusal(context, method)
            if message is not None:
                context.abort(status, message)
            if handler.request_streaming:
                return inner(requests, context)
            return inner(one_message(requests, context, method), context)

        make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler)
        return make(serve, handler.request_deserializer, handler.response_serializer)
