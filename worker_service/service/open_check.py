"""The probes' health check, served to callers without the worker's credential so that they
cannot hold the server's threads (auth.py).

A unary call holds one of the pool's threads from the moment its headers arrive until its request
message does, and the caller decides when that is: eight `Check` calls whose message never came
held all eight threads, and the scheduler's Health calls queued behind them. So an
unauthenticated `Check` is served as a request stream: at most `limit` at a time, each cancelled
when its message has not come within `wait_s`. A probe sends one check at a time, whole.

When every slot is taken, a new check cancels the oldest one still waiting for its message and
takes its place. Refusing the newcomer (RESOURCE_EXHAUSTED) instead let two withheld checks,
reopened as each was cancelled, answer every Kubernetes probe RESOURCE_EXHAUSTED: the liveness
probe failed and the kubelet restarted a healthy worker (a hostile run, session 38). A probe's message comes with its headers, so its
wait is over before another caller could cancel it; a withholding caller only cancels its own.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import grpc

# Unauthenticated checks served at once: the scheduler's Step stream and Health calls keep the
# rest of the pool's threads.
MAX_OPEN_CHECKS = 2
# Seconds an unauthenticated check may take to send its request message.
OPEN_CHECK_WAIT_S = 2.0


class OpenChecks:
    """Serves unauthenticated calls of a unary-unary method with bounded threads and waits."""

    def __init__(self, limit: int = MAX_OPEN_CHECKS, wait_s: float | None = None):
        self.limit = limit
        self.wait_s = OPEN_CHECK_WAIT_S if wait_s is None else wait_s   # read now: tests set it
        self._lock = threading.Lock()
        self._waiting: OrderedDict = OrderedDict()   # id -> context of a call without its message

    def guard(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler`'s behaviour behind the limit and the wait."""

        def serve(requests, context):
            self._take_slot(context)
            try:
                request = self._first(requests, context)
            finally:
                with self._lock:
                    self._waiting.pop(id(context), None)
            return handler.unary_unary(request, context)

        return grpc.stream_unary_rpc_method_handler(serve, handler.request_deserializer,
                                                    handler.response_serializer)

    def _take_slot(self, context) -> None:
        """A slot for this call; when all are taken, the oldest waiting call is cancelled (its
        thread ends as soon as the cancel reaches it) and gives up its slot."""
        with self._lock:
            while len(self._waiting) >= self.limit:
                _, oldest = self._waiting.popitem(last=False)
                oldest.cancel()
            self._waiting[id(context)] = context

    def _first(self, requests, context):
        """The call's request message; the call is cancelled when it has not come in time."""
        timer = threading.Timer(self.wait_s, context.cancel)
        timer.daemon = True
        timer.start()
        try:
            return one_message(requests, context, "a health check")
        finally:
            timer.cancel()


def one_message(requests, context, what: str):
    """The one request message of a unary call served as a request stream (aborts
    INVALID_ARGUMENT when the stream ends without it)."""
    request = next(requests, None)
    if request is None:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} must carry one request message")
    return request
