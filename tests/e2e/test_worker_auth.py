"""Nobody else drives a worker: the Worker protocol's credentials over real processes.

- `deltaserve serve` with default flags: an outsider's Step, Reset, Init, Info and Health on the
  worker port are refused UNAUTHENTICATED (no token, or a wrong one) while the open Generate
  streams run on and finish with the tokens they give alone.
- Separate worker and scheduler, the worker holding the token's digest and the scheduler the
  token: a refused Init (a directory that is no
  model, a stale epoch) leaves the model loaded and the epoch and owner unchanged.
- Mutual TLS: the worker takes only clients with a certificate of its CA that carries a name of
  --worker-tls-allowed-clients (not its own serving certificate); the scheduler verifies the
  worker's.
- A worker with no credential refuses to listen beyond loopback unless --insecure.
"""
from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine_common.security.worker_auth import token_digest_text
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from tests.support.certs import make_ca, make_cert
from tests.support.grpc_harness import (Processes, bearer, child_env, collect, free_port,
                                        generation_stub, greedy_request, health_status, pb,
                                        wait_for, wait_ready, worker_info, write_token)
from tests.support.paths import REPO
from bench.worker_port_flood import KINDS, PortFlood

pytestmark = pytest.mark.slow

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def _outsider_calls(stub: worker_pb2_grpc.WorkerStub, metadata: tuple) -> dict[str, object]:
    """Every Worker RPC an outsider could use to take the worker over or learn about it."""
    step = worker_pb2.StepRequest(epoch=2**62, step=0, payload=b"")
    return {
        "Step": lambda: list(stub.Step(iter([step]), timeout=10, metadata=metadata)),
        "Reset": lambda: stub.Reset(worker_pb2.ResetRequest(epoch=2**62), timeout=10,
                                    metadata=metadata),
        "Init": lambda: stub.Init(worker_pb2.InitRequest(
            epoch=2**62, config=worker_pb2.WorkerConfig(model_dir="/etc")), timeout=10,
            metadata=metadata),
        "Info": lambda: stub.Info(worker_pb2.InfoRequest(), timeout=10, metadata=metadata),
        "Health": lambda: stub.Health(worker_pb2.HealthRequest(), timeout=10,
                                      metadata=metadata),
    }


def _refusals(address: str, metadata: tuple) -> dict[str, str]:
    """name -> the status each outsider call got ("OK" if one got through)."""
    out = {}
    with grpc.insecure_channel(address) as channel:
        for name, call in _outsider_calls(worker_pb2_grpc.WorkerStub(channel), metadata).items():
            try:
                call()
                out[name] = "OK"
            except grpc.RpcError as e:
                out[name] = e.code().name
    return out


def _streams_in_threads(target: str, reqs) -> tuple[list, list[threading.Thread]]:
    results: list = [None] * len(reqs)

    def run(i: int) -> None:
        with grpc.insecure_channel(target) as ch:
            try:
                results[i] = collect(generation_stub(ch).Generate(reqs[i], timeout=180))
            except grpc.RpcError as e:
                results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    return results, threads


def test_serve_refuses_an_outsider_and_its_streams_finish(tiny_models, tmp_path):
    procs = Processes(tmp_path)
    try:
        port, worker_port = free_port(), free_port()
        serve = procs.serve(port, worker_port, "--model", tiny_models("qwen3"))
        target, worker = f"127.0.0.1:{port}", f"127.0.0.1:{worker_port}"
        wait_ready(target, [serve])
        reqs = [greedy_request([3 + i, 14, 15, 92], 200, f"s{i}") for i in range(3)]
        results, threads = _streams_in_threads(target, reqs)
        rounds, while_open = [], 0
        while any(t.is_alive() for t in threads) or not rounds:
            for metadata in ((), bearer("wrong-token-0123456789")):
                rounds.append(_refusals(worker, metadata))
            while_open += all(t.is_alive() for t in threads)
        for t in threads:
            t.join(60)
        assert while_open >= 1, "the streams ended before an outsider call was made"
        assert all(r == dict.fromkeys(r, "UNAUTHENTICATED") for r in rounds), rounds
        with grpc.insecure_channel(target) as ch:
            for req, result in zip(reqs, results):
                assert not isinstance(result, grpc.RpcError), result
                ids, _, msgs = result
                assert msgs[-1].finish_reason == pb.LENGTH and len(ids) == 200
                alone, _, _ = collect(generation_stub(ch).Generate(req, timeout=120))
                assert ids == alone
        assert "refused /deltaserve.v1.Worker/Step" in serve.log_tail(200_000)
    finally:
        procs.close()


@pytest.fixture(scope="module")
def token_cluster(tiny_models, tmp_path_factory):
    """A worker holding the token's digest and a scheduler the token: (procs, worker port,
    target, token).
    Shared: neither test changes it (refused Inits leave it as it was, which one test asserts;
    the other's flood of unauthenticated streams is closed before it ends)."""
    tmp_path = tmp_path_factory.mktemp("token-cluster")
    procs = Processes(tmp_path)
    token_file = tmp_path / "worker-token"
    token = write_token(token_file)
    digest_file = tmp_path / "worker-token-digest"
    digest_file.write_text(token_digest_text(token) + "\n")
    w_port, s_port = free_port(), free_port()
    worker = procs.worker(w_port, "--worker-token-file", str(digest_file))
    sched = procs.scheduler(tiny_models("qwen3"), [w_port], s_port, "--worker-token-file",
                            str(token_file))
    try:
        wait_ready(f"127.0.0.1:{s_port}", [worker, sched])
        yield procs, w_port, f"127.0.0.1:{s_port}", token
    finally:
        procs.close()


def test_a_refused_init_leaves_the_model_loaded(token_cluster):
    procs, w_port, target, token = token_cluster
    worker_proc = procs.procs[0]
    before = worker_info(w_port, token)
    assert before.model_loaded and before.epoch > 0 and before.scheduler_id
    with grpc.insecure_channel(f"127.0.0.1:{w_port}") as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        cases = [  # (the Init, the status, a fragment of its message)
            (worker_pb2.InitRequest(epoch=before.epoch + 100, scheduler_id="intruder",
                                    config=worker_pb2.WorkerConfig(model_dir="/etc")),
             grpc.StatusCode.INVALID_ARGUMENT, "config.json not found"),
            (worker_pb2.InitRequest(epoch=before.epoch + 100, scheduler_id="intruder",
                                    config=worker_pb2.WorkerConfig(model_dir=before.model_dir,
                                                                   dtype="float16",
                                                                   attention_backend="flash_attn")),
             grpc.StatusCode.INVALID_ARGUMENT, "flash"),
            (worker_pb2.InitRequest(epoch=before.epoch, scheduler_id="intruder",
                                    config=worker_pb2.WorkerConfig(model_dir=before.model_dir)),
             grpc.StatusCode.FAILED_PRECONDITION,
             f"epoch {before.epoch} is stale: the worker's epoch is {before.epoch}"),
            # issue 23: INTERNAL after the epoch and owner had changed
            (worker_pb2.InitRequest(epoch=before.epoch + 100, scheduler_id="intruder",
                                    config=worker_pb2.WorkerConfig(model_dir=before.model_dir,
                                                                   kv_cache_bytes=2**62)),
             grpc.StatusCode.FAILED_PRECONDITION,
             "its KV cache 4294967296.00 GiB per rank, more than this machine's"),
        ]
        for request, status, fragment in cases:
            with pytest.raises(grpc.RpcError) as err:
                stub.Init(request, timeout=30, metadata=bearer(token))
            assert err.value.code() == status and fragment in err.value.details(), err.value
    after = worker_info(w_port, token)
    kept = ("model_loaded", "model_dir", "epoch", "scheduler_id", "dtype", "attention_backend",
            "num_kv_blocks", "group_id")
    assert [getattr(after, f) for f in kept] == [getattr(before, f) for f in kept]
    with grpc.insecure_channel(target) as ch:
        ids, _, msgs = collect(generation_stub(ch).Generate(greedy_request([5, 6, 7], 8),
                                                            timeout=60))
    assert len(ids) == 8 and msgs[-1].finish_reason == pb.LENGTH
    assert worker_proc.log_tail(200_000).count("loaded model ") == 1


def test_unauthenticated_streams_hold_no_worker_thread(token_cluster):
    """Issue 23: seven reflection streams held open filled the worker's 8 threads (the
    scheduler's Step stream holds the eighth), its Health calls queued, and the scheduler declared
    the worker gone. 32 of every stream the port answers are held open here."""
    procs, w_port, target, token = token_cluster
    address = f"127.0.0.1:{w_port}"
    with PortFlood(address, per_kind=32) as flood:
        flood.wait_settled(30)
        with grpc.insecure_channel(address) as ch:   # the scheduler's own check, with the token
            reply = worker_pb2_grpc.WorkerStub(ch).Health(worker_pb2.HealthRequest(), timeout=5,
                                                          metadata=bearer(token))
        assert reply.ready, reply
        assert health_status(address, "", timeout=5) == "SERVING"   # probes: Check stays open
        with grpc.insecure_channel(target) as ch:
            for i in range(4):
                ids, _, msgs = collect(generation_stub(ch).Generate(
                    greedy_request([5 + i, 6, 7], 8), timeout=60))
                assert len(ids) == 8 and msgs[-1].finish_reason == pb.LENGTH
        outcomes = flood.outcomes()
    assert outcomes == {kind: {"UNAUTHENTICATED": 32} for kind in KINDS}
    assert health_status(target, "deltaserve.v1.Generation") == "SERVING"
    # With the token, reflection still answers (grpcurl -H 'authorization: Bearer ...').
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=10,
                                                 metadata=bearer(token)))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "deltaserve.v1.Worker" in names


def test_mutual_tls_between_worker_and_scheduler(tiny_models, tmp_path):
    ca = make_ca(tmp_path, "ca")
    # usable as a client's too, as a cluster CA issues them: --worker-tls-allowed-clients keeps
    # it (another worker's) from driving the worker
    server = make_cert(tmp_path, ca, "worker", hosts=("127.0.0.1", "localhost"), client=True)
    client = make_cert(tmp_path, ca, "scheduler")
    rogue_ca = make_ca(tmp_path, "rogue-ca")
    rogue = make_cert(tmp_path, rogue_ca, "rogue")
    procs = Processes(tmp_path)
    try:
        w_port, s_port = free_port(), free_port()
        worker = procs.worker(w_port, "--worker-tls-cert", str(server.cert), "--worker-tls-key",
                              str(server.key), "--worker-tls-ca", str(ca.cert),
                              "--worker-tls-allowed-clients", "scheduler")
        sched = procs.scheduler(tiny_models("qwen3"), [w_port], s_port,
                                "--worker-tls-cert", str(client.cert),
                                "--worker-tls-key", str(client.key),
                                "--worker-tls-ca", str(ca.cert))
        target = f"127.0.0.1:{s_port}"
        wait_ready(target, [worker, sched])
        with grpc.insecure_channel(target) as ch:
            ids, _, _ = collect(generation_stub(ch).Generate(greedy_request([5, 6], 6), timeout=60))
        assert len(ids) == 6
        address = f"127.0.0.1:{w_port}"
        ca_pem = ca.cert.read_bytes()

        def info(credentials) -> str:
            channel = (grpc.insecure_channel(address) if credentials is None
                       else grpc.secure_channel(address, credentials))
            with channel:
                try:
                    reply = worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(),
                                                                     timeout=10)
                    return "loaded" if reply.model_loaded else "empty"
                except grpc.RpcError as e:
                    return e.code().name

        assert info(None) == "UNAVAILABLE"                                   # plaintext
        assert info(grpc.ssl_channel_credentials(ca_pem)) == "UNAVAILABLE"  # no client cert
        assert info(grpc.ssl_channel_credentials(
            ca_pem, rogue.key.read_bytes(), rogue.cert.read_bytes())) == "UNAVAILABLE"
        assert info(grpc.ssl_channel_credentials(
            ca_pem, client.key.read_bytes(), client.cert.read_bytes())) == "loaded"
        assert info(grpc.ssl_channel_credentials(
            ca_pem, server.key.read_bytes(), server.cert.read_bytes())) == "PERMISSION_DENIED"
        assert "mutual TLS, clients named 'scheduler' only" in worker.log_tail(20_000)
    finally:
        procs.close()


def test_a_worker_without_credentials_stays_on_loopback(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "worker", "--listen", f"0.0.0.0:{port}",
           "--device", "cpu"]
    out = subprocess.run(cmd, cwd=REPO, env=child_env(None), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "deltaserve worker: error: listen='0.0.0.0:" in out.stderr
    assert "--worker-token-file" in out.stderr and "--insecure" in out.stderr
    procs = Processes(tmp_path)
    try:
        worker = procs.worker(port, "--insecure", host="0.0.0.0")
        wait_for(lambda: "listening on" in worker.log_tail(), 120, "the --insecure worker",
                 [worker])
        assert "NOT authenticated" in worker.log_tail(20_000)
    finally:
        procs.close()
