"""Who may drive this worker: the token check, the TLS port, and the start-up rule.

- `TokenCheck` is a server interceptor: a call whose `authorization` metadata does not carry the
  worker's token (checked against its SHA-256 digest) is refused UNAUTHENTICATED before any handler runs (a Step stream is never
  opened, so the owner's stream is not superseded). Only grpc.health.v1's `Check` stays open,
  for probes: it answers from memory at once. Nothing an unauthenticated caller may open holds
  one of the server's pooled threads (issue 23: seven reflection streams held open starved the
  scheduler's Health calls), so health `Watch` and server reflection, both streams that hold a
  thread as long as the caller keeps them open, need the token too. A refusal never waits for a
  request message (a unary handler would hold its thread until the caller sends it), and an
  unauthenticated `Check` is served with bounded threads and waits (open_check.py).
- `add_port` binds the listen address with TLS (a client certificate signed by the CA is
  required) when the worker has a certificate, plaintext otherwise. With
  --worker-tls-allowed-clients the certificate must also carry an allowed name
  (client_names.py; refused PERMISSION_DENIED, OPEN_METHODS stay open); without it any
  certificate of the CA drives the worker, and the ready line warns so.
- `check_exposure`: a worker with no credential refuses to listen beyond loopback unless
  --insecure is given (its ready line says it runs unauthenticated).
"""
from __future__ import annotations

import ipaddress
import logging

import grpc

from engine_common.request.params import ParamError
from engine_common.security.tls import server_credentials
from engine_common.security.worker_auth import AUTH_METADATA_KEY, WorkerAuth
from worker_service.failures import FailureKind
from worker_service.service.client_names import ClientNameCheck
from worker_service.service.log_limit import LogLimit
from worker_service.service.open_check import OpenChecks
from worker_service.service.servicer import FAILURES

log = logging.getLogger(__name__)

# NOTE the one method any caller may use: the probes' health check. It reveals readiness only and
# returns once its request has come (OpenChecks bounds the threads and the wait); every method
# that streams (health Watch, reflection, Step) would hold one of the pool's threads for as long
# as its caller wishes.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


class TokenCheck(grpc.ServerInterceptor):
    """Refuses every call without `authorization: Bearer <token>` (but OPEN_METHODS)."""

    def __init__(self, auth: WorkerAuth, log_limit: LogLimit | None = None,
                 open_checks: OpenChecks | None = None):
        self.auth = auth
        # Refusals are logged at most once per 10 s: an outsider repeats them at will.
        self._log_limit = log_limit or LogLimit(10.0)
        self._open_checks = open_checks or OpenChecks()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        header = dict(handler_call_details.invocation_metadata or ()).get(AUTH_METADATA_KEY)
        if self.auth.accepts(header):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:   # an unknown method stays UNIMPLEMENTED
            return None
        if method in OPEN_METHODS:
            return self._open_checks.guard(handler)
        skipped = self._log_limit.take()
        if skipped is not None:
            log.warning("refused %s: %s (and %d other refused calls since the last such line)",
                        method, "no token" if header is None else "wrong token", skipped)
        return _refusal(handler, "missing" if header is None else "wrong")


def _refusal(handler: grpc.RpcMethodHandler, what: str) -> grpc.RpcMethodHandler:
    """A handler with `handler`'s response shape that only aborts UNAUTHENTICATED. It takes
    a request stream whatever the method's shape: grpc serves a unary request by waiting, on a
    pool thread, for its message, which the caller may never send."""
    status = FAILURES[FailureKind.UNAUTHENTICATED][1]
    message = (f"{what} worker credential: every Worker RPC must carry `{AUTH_METADATA_KEY}: "
               "Bearer <token>` (the token itself, as the scheduler's --worker-token-file "
               "holds it; a worker's may hold only its sha256: digest)")

    def abort(requests, context):
        context.abort(status, message)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    return grpc.stream_unary_rpc_method_handler(abort)


def interceptors(auth: WorkerAuth) -> tuple[grpc.ServerInterceptor, ...]:
    """The token check and the client-name check, each when the worker has it."""
    out: tuple[grpc.ServerInterceptor, ...] = (TokenCheck(auth),) if auth.checks_token else ()
    if auth.tls and auth.allowed_clients:
        # Without a token check in front, the name check guards the open methods itself.
        out += (ClientNameCheck(auth.allowed_clients, OPEN_METHODS,
                                open_checks=None if auth.checks_token else OpenChecks()),)
    return out


def add_port(server: grpc.Server, listen: str, auth: WorkerAuth) -> int:
    """Bind `listen` (TLS requiring a client certificate when `auth` has one); the port.
    OSError when it cannot be bound (grpc raises a RuntimeError: a port in use was a traceback
    and exit code 1 instead of the CLI's one line and 2)."""
    try:
        if auth.tls:
            return server.add_secure_port(listen,
                                          server_credentials(auth.cert, auth.key, auth.ca))
        return server.add_insecure_port(listen)
    except RuntimeError as e:
        raise OSError(f"could not listen on {listen}: {e}") from None


def is_loopback(listen: str) -> bool:
    """Whether HOST of HOST:PORT is a loopback name or address (an empty host, 0.0.0.0 or [::]
    listens everywhere)."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(listen: str, auth: WorkerAuth, insecure: bool) -> None:
    """ParamError for a worker without credentials on a non-loopback address, unless
    `insecure`."""
    if not auth.enabled and not is_loopback(listen) and not insecure:
        raise ParamError("listen", listen, "a loopback address for a worker without "
                         "credentials: give --worker-token-file FILE or --worker-tls-cert/"
                         "--worker-tls-key/--worker-tls-ca (or --insecure to let anyone who "
                         "reaches the port drive this worker)")


def describe(auth: WorkerAuth) -> str:
    """How the worker is guarded, for its ready line."""
    held = ("; WARNING: this worker holds the token itself, which drives every worker that "
            "accepts it (give workers its digest: --worker-token-file holding sha256:HEX, "
            "docs/security.md)") if auth.token is not None else ""
    if auth.tls:
        return ("token and " if auth.checks_token else "") + _describe_tls(auth) + held
    if held:
        return "token" + held
    if auth.enabled:
        return "token (its digest: this worker holds nothing that drives another)"
    return ("NOT authenticated: any process that reaches the port can drive this worker (give "
            "--worker-token-file or --worker-tls-*)")


def _describe_tls(auth: WorkerAuth) -> str:
    if auth.allowed_clients:
        return ("mutual TLS, clients named " + ", ".join(map(ascii, sorted(auth.allowed_clients)))
                + " only")
    return ("mutual TLS; WARNING: any certificate --worker-tls-ca signed may drive this worker, "
            "another worker's included (name the scheduler's certificate in "
            "--worker-tls-allowed-clients)")
