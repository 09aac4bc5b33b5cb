"""worker_service/service/auth.py: where a worker without credentials may listen, how often its
refusals are logged, and a worker that holds only the token's digest."""
from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import grpc
import pytest

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.request.params import ParamError
from engine_common.security.worker_auth import WorkerAuth, WorkerCredentials, token_digest_text
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from tests.support.grpc_harness import bearer
from worker_service.service.auth import TokenCheck, check_exposure, describe, is_loopback
from worker_service.service.server import serve_worker
from worker_service.service.log_limit import LogLimit


@pytest.mark.parametrize("listen,loopback", [
    ("127.0.0.1:50052", True), ("127.3.4.5:1", True), ("localhost:1", True), ("[::1]:1", True),
    ("0.0.0.0:50052", False), ("[::]:1", False), (":50052", False), ("10.0.0.1:1", False),
    ("worker-0.svc:1", False),
])
def test_loopback_addresses(listen, loopback):
    assert is_loopback(listen) is loopback


def test_no_credential_beyond_loopback_needs_insecure():
    with pytest.raises(ParamError, match=r"listen='0.0.0.0:50052' is invalid: must be a "
                                         r"loopback address .*--worker-token-file"):
        check_exposure("0.0.0.0:50052", WorkerAuth(), insecure=False)
    check_exposure("0.0.0.0:50052", WorkerAuth(), insecure=True)
    check_exposure("0.0.0.0:50052", WorkerAuth(token="t" * 16), insecure=False)
    check_exposure("127.0.0.1:50052", WorkerAuth(), insecure=False)


def test_refusals_are_logged_at_most_once_per_interval(caplog):
    """Issue 23: every refused call logged a WARNING (7,000 lines in 5 s)."""
    now = [0.0]
    check = TokenCheck(WorkerAuth(token="t" * 16), LogLimit(10.0, clock=lambda: now[0]))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)
    details = SimpleNamespace(method="/deltaserve.v1.Worker/Info", invocation_metadata=())
    with caplog.at_level(logging.WARNING, logger="worker_service.service.auth"):
        for _ in range(7000):
            assert check.intercept_service(lambda d: handler, details) is not handler
        now[0] = 10.0
        check.intercept_service(lambda d: handler, details)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused /deltaserve.v1.Worker/Info: no token (and 0 other refused calls "
                     "since the last such line)",
                     "refused /deltaserve.v1.Worker/Info: no token (and 6999 other refused "
                     "calls since the last such line)"]


def test_a_log_limit_counts_what_it_leaves_out():
    now = [100.0]
    limit = LogLimit(5.0, clock=lambda: now[0])
    assert limit.take() == 0
    assert [limit.take() for _ in range(3)] == [None] * 3
    now[0] = 104.9
    assert limit.take() is None
    now[0] = 105.0
    assert limit.take() == 4 and limit.take() is None


TOKEN = "test-token-0123456789abcdef"


def test_the_ready_line_warns_a_worker_that_holds_the_token():
    assert "WARNING: this worker holds the token itself" in describe(WorkerAuth(token=TOKEN))
    digest_only = WorkerAuth(token_digest=WorkerAuth(token=TOKEN).token_digest)
    assert describe(digest_only).startswith("token (its digest")
    assert "WARNING" not in describe(digest_only)
    pem = b"-----BEGIN CERTIFICATE-----\n"
    tls = dict(cert=pem, key=pem, ca=pem, allowed_clients=frozenset({"scheduler"}))
    assert "holds the token itself" in describe(WorkerAuth(token=TOKEN, **tls))
    assert "WARNING" not in describe(WorkerAuth(token_digest=digest_only.token_digest, **tls))


def test_a_real_worker_given_the_digest_serves_the_token_and_refuses_the_digest():
    """The worker process holds sha256:HEX only: the scheduler's token drives it, and the
    digest it holds (all an intruder in it could read) is refused like any wrong token."""
    digest = token_digest_text(TOKEN)
    auth = WorkerCredentials(worker_token_file="-").load(io.StringIO(digest + "\n"))
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"), auth)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            health = worker_pb2_grpc.WorkerStub(channel).Health
            reply = health(worker_pb2.HealthRequest(), timeout=30, metadata=bearer(TOKEN))
            assert (reply.ready, reply.reason) == (False, "not initialized")
            for sent in (digest, digest.removeprefix("sha256:"), None):
                with pytest.raises(grpc.RpcError) as refused:
                    health(worker_pb2.HealthRequest(), timeout=30, metadata=bearer(sent))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, sent
    finally:
        server.stop(None)
        server.node_worker.close()
