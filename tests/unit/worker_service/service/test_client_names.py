"""--worker-tls-allowed-clients: under mutual TLS only a client certificate carrying an allowed
name drives the worker; another certificate of the same CA (a worker's own serving certificate)
is refused PERMISSION_DENIED before any handler runs. Real worker services on loopback, with
certificates made here and no model."""
from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from engine_common.security.worker_auth import WorkerAuth
from tests.support.certs import make_ca, make_cert
from worker_service.service.auth import describe
from worker_service.service import open_check
from worker_service.service.server import serve_worker

ALLOWED = frozenset({"scheduler.deltaserve.svc", "spiffe://cluster/ns/deltaserve/sa/scheduler",
                     "ops"})
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """name -> (key, cert) PEM bytes, all signed by one CA ("ca" -> the CA's cert)."""
    d = tmp_path_factory.mktemp("certs")
    ca = make_ca(d, "cluster-ca")
    made = {
        # the worker's serving certificate, usable as a client's too (as a cluster CA issues it)
        "worker": make_cert(d, ca, "worker", hosts=("127.0.0.1",), client=True,
                            sans=("DNS:worker-0.deltaserve.svc",)),
        "by-dns": make_cert(d, ca, "scheduler", sans=("DNS:scheduler.deltaserve.svc",)),
        "by-uri": make_cert(d, ca, "sched", sans=("URI:spiffe://cluster/ns/deltaserve/sa/"
                                                   "scheduler",)),
        "by-cn": make_cert(d, ca, "ops"),
        # near misses: an allowed name as an e-mail entry, in another case, within a longer name
        "near": make_cert(d, ca, "OPS", sans=("email:ops", "DNS:scheduler.deltaserve.svc.evil",
                                              "DNS:ops.deltaserve.svc")),
        # names that would forge a log line if written as they are, one very long
        "forger": make_cert(d, ca, "forger", common_name="x\nERROR forged",
                            sans=("DNS:" + "y" * 200,)),
    }
    out = {name: (pem.key.read_bytes(), pem.cert.read_bytes()) for name, pem in made.items()}
    out["ca"] = (ca.key.read_bytes(), ca.cert.read_bytes())
    return out


TOKEN = "test-token-0123456789abcdef"


def _auth(certs, allowed: frozenset[str] = frozenset(), token: str | None = None) -> WorkerAuth:
    key, cert = certs["worker"]
    return WorkerAuth(token=token, cert=cert, key=key, ca=certs["ca"][1], allowed_clients=allowed)


@pytest.fixture(scope="module")
def workers(certs):
    """name -> address of a worker: "allowed" (ALLOWED), "unset" (without the option), "token"
    (ALLOWED and TOKEN)."""
    auths = {"allowed": _auth(certs, ALLOWED), "unset": _auth(certs),
             "token": _auth(certs, ALLOWED, TOKEN)}
    servers = {name: serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"), auth)
               for name, auth in auths.items()}
    try:
        yield {name: f"127.0.0.1:{s.bound_port}" for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop(None)
            s.node_worker.close()


def _channel(certs, address: str, client: str) -> grpc.Channel:
    key, cert = certs[client]
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(certs["ca"][1], key, cert))


def _info(certs, address: str, client: str, token: str | None = None) -> str:
    """"OK" or the status's code and message."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with _channel(certs, address, client) as ch:
        try:
            worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=10,
                                                metadata=metadata)
            return "OK"
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"


def test_the_schedulers_certificate_drives_the_worker_and_a_workers_is_refused(certs, workers):
    assert _info(certs, workers["allowed"], "by-dns") == "OK"
    refused = _info(certs, workers["allowed"], "worker")
    assert refused == ("PERMISSION_DENIED: client certificate not allowed: it carries CN "
                       "'worker', DNS 'worker-0.deltaserve.svc', none of them in this worker's "
                       "--worker-tls-allowed-clients")


def test_a_dns_or_uri_name_or_the_common_name_allows_and_nothing_else(certs, workers):
    for client in ("by-dns", "by-uri", "by-cn"):
        assert _info(certs, workers["allowed"], client) == "OK", client
    near = _info(certs, workers["allowed"], "near")
    assert near.startswith("PERMISSION_DENIED: client certificate not allowed: it carries CN "
                           "'OPS', DNS 'scheduler.deltaserve.svc.evil', DNS "
                           "'ops.deltaserve.svc', none"), near


def test_a_refusal_escapes_and_clips_the_presented_names(certs, workers):
    refused = _info(certs, workers["allowed"], "forger")
    assert refused.startswith("PERMISSION_DENIED: client certificate not allowed: it carries "
                              "CN 'x\\nERROR forged', DNS 'yyy"), refused
    assert "\n" not in refused and "... (202 characters), none" in refused, refused


def test_without_the_option_any_certificate_of_the_ca_is_accepted_with_a_warning(certs,
                                                                                  workers):
    for client in ("by-dns", "worker", "near"):
        assert _info(certs, workers["unset"], client) == "OK", client
    assert "WARNING: any certificate --worker-tls-ca signed may drive this worker" in \
        describe(_auth(certs))
    assert describe(_auth(certs, ALLOWED)) == (
        "mutual TLS, clients named 'ops', 'scheduler.deltaserve.svc', "
        "'spiffe://cluster/ns/deltaserve/sa/scheduler' only")


def test_with_a_token_too_both_are_needed(certs, workers):
    address = workers["token"]
    assert _info(certs, address, "by-dns", TOKEN) == "OK"
    assert _info(certs, address, "worker", TOKEN).startswith("PERMISSION_DENIED: client "
                                                             "certificate not allowed")
    assert _info(certs, address, "by-dns").startswith("UNAUTHENTICATED: missing worker "
                                                      "credential")


def test_a_refused_client_changes_nothing_and_health_check_stays_open(certs, workers):
    address = workers["allowed"]
    with _channel(certs, address, "worker") as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        calls = {
            "Init": lambda: stub.Init(worker_pb2.InitRequest(
                epoch=7, scheduler_id="intruder",
                config=worker_pb2.WorkerConfig(model_dir="/nonexistent")), timeout=10),
            "Reset": lambda: stub.Reset(worker_pb2.ResetRequest(epoch=7), timeout=10),
            "Step": lambda: list(stub.Step(iter([worker_pb2.StepRequest(epoch=7)]),
                                           timeout=10)),
            "Health": lambda: stub.Health(worker_pb2.HealthRequest(), timeout=10),
        }
        codes = {}
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            codes[name] = err.value.code()
        health = health_pb2_grpc.HealthStub(ch)
        check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        with pytest.raises(grpc.RpcError) as watch:
            next(health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10))
    assert codes == dict.fromkeys(calls, DENIED) and watch.value.code() == DENIED
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    with _channel(certs, address, "by-dns") as ch:
        info = worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=10)
    assert (info.epoch, info.scheduler_id, info.model_loaded) == (0, "", False)


def test_a_refusal_does_not_wait_for_the_request_message(certs, workers):
    """A unary call whose message does not come is refused at once: it holds none of the
    worker's 8 pool threads (12 such calls from a refused certificate are all answered)."""
    release = threading.Event()

    def nothing_yet():
        release.wait()
        yield from ()

    try:
        with _channel(certs, workers["allowed"], "worker") as ch:
            calls = [ch.stream_unary("/deltaserve.v1.Worker/Init").future(nothing_yet(),
                                                                          timeout=10)
                     for _ in range(12)]
            codes = [call.exception().code() for call in calls]
    finally:
        release.set()
    assert codes == [DENIED] * 12


def test_withheld_health_checks_of_a_refused_certificate_hold_no_worker_thread(certs,
                                                                             monkeypatch):
    """Health Check stays open to a refused certificate, but as to a caller without the token:
    eight of its checks whose message never comes (the worker's 8 pool threads) leave the
    scheduler's call answered, and each is cancelled or refused, none served."""
    monkeypatch.setattr(open_check, "OPEN_CHECK_WAIT_S", 0.2)     # the wait ends: not its length
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"),
                          _auth(certs, ALLOWED))
    address = f"127.0.0.1:{server.bound_port}"
    release = threading.Event()

    def nothing_yet():
        release.wait()
        yield from ()

    try:
        with _channel(certs, address, "worker") as ch:
            checks = [ch.stream_unary("/grpc.health.v1.Health/Check").future(nothing_yet(),
                                                                              timeout=60)
                      for _ in range(8)]
            assert _info(certs, address, "by-dns") == "OK"
            codes = {call.exception(timeout=30).code().name for call in checks}
        assert codes <= {"CANCELLED", "RESOURCE_EXHAUSTED"}, codes
    finally:
        release.set()
        server.stop(None)
        server.node_worker.close()
