"""The public API's guards over real processes: request limits and undecodable bytes, TLS and
mutual TLS with the real grpcurl (-cacert), API keys (health open, reflection behind the key,
Abort only by the key that made the request); the same on the port's VllmEngine service (the
smg gateway's protocol)."""
from __future__ import annotations

import subprocess
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_common.wire.protos import GENERATION_SERVICE, VLLM_ENGINE_SERVICE, vllm_engine_pb2
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.certs import make_ca, make_cert
from tests.support.grpc_harness import (GRPCURL, Processes, collect, free_port, generation_stub,
                                        greedy_request, json_stream, pb, wait_for, wait_ready)

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"


def _cluster(tiny_models, tmp_path, *flags: str, ready=None) -> tuple[Processes, str]:
    procs = Processes(tmp_path)
    w_port, s_port = free_port(), free_port()
    worker = procs.worker(w_port)
    sched = procs.scheduler(tiny_models("qwen3"), [w_port], s_port, *flags)
    target = f"127.0.0.1:{s_port}"
    try:
        if ready is None:
            wait_ready(target, [worker, sched])
        else:
            wait_for(lambda: "DeltaServe scheduler ready" in sched.log_tail(), 120,
                     "the scheduler's ready line", [worker, sched])
    except BaseException:
        procs.close()
        raise
    return procs, target


def _grpcurl(*args: str, data: str | None = None) -> subprocess.CompletedProcess:
    if not GRPCURL or not __import__("os").path.isfile(GRPCURL):
        pytest.skip("no grpcurl binary (it comes with the dev extras)")
    cmd = [GRPCURL, *args] if data is None else [GRPCURL, "-d", data, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


# ---- limits and undecodable requests, default flags -------------------------------------------

@pytest.fixture(scope="module")
def plain(tiny_models, tmp_path_factory):
    procs, target = _cluster(tiny_models, tmp_path_factory.mktemp("plain"),
                             "--max-prompt-chars", "1000")
    yield target
    procs.close()


def _status(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_200000_stop_strings_are_refused(plain):
    req = greedy_request([5, 6, 7], 4)
    req.stopping.stop.extend(f"s{i}" for i in range(200_000))    # 1.4 MB of stop strings
    with grpc.insecure_channel(plain) as ch:
        code, details = _status(lambda: collect(generation_stub(ch).Generate(req, timeout=60)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "stopping.stop='200000 strings' is invalid: must be at most 64" in details
        long_text = pb.TokenizeRequest(text="x" * 1001)
        code, details = _status(lambda: generation_stub(ch).Tokenize(long_text, timeout=60))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-chars" in details
        ok = collect(generation_stub(ch).Generate(greedy_request([5, 6, 7], 4), timeout=60))
        assert len(ok[0]) == 4
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        many = _vllm_request(stop=[f"s{i}" for i in range(200_000)])
        code, details = _status(lambda: list(vllm.Generate(many, timeout=60)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling_params.stop='200000 strings' is invalid: must be at most 64" in details
        code, details = _status(lambda: list(vllm.Generate(vllm_engine_pb2.GenerateRequest(
            request_id="long-text", text="x" * 1001), timeout=60)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-chars" in details


def _vllm_request(**sampling) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id="v", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=3, temperature=0, **sampling))


def test_undecodable_requests_are_invalid_argument(plain):
    with grpc.insecure_channel(plain) as ch:
        for method, streaming in (("Generate", True), ("Tokenize", False), ("Abort", False)):
            path = f"/{GENERATION_SERVICE}/{method}"
            if streaming:
                call = ch.unary_stream(path)
                code, details = _status(lambda: list(call(b"\xff\xff\xff\xff", timeout=30)))
            else:
                call = ch.unary_unary(path)
                code, details = _status(lambda: call(b"\x0a\xff\xff\xff\x0f", timeout=30))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
            assert f"the request to {GENERATION_SERVICE}/{method} could not be decoded" in details


# ---- TLS with API keys ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ca = make_ca(d, "api-ca")
    return {"dir": d, "ca": ca,
            "server": make_cert(d, ca, "scheduler", hosts=("127.0.0.1", "localhost")),
            "client": make_cert(d, ca, "client")}


@pytest.fixture(scope="module")
def tls_keys(tiny_models, tmp_path_factory, certs):
    tmp = tmp_path_factory.mktemp("tls-keys")
    keys = tmp / "api-keys"
    keys.write_text(f"# two tenants\n{KEY_A}\n{KEY_B}\n")
    procs, target = _cluster(tiny_models, tmp, "--tls-cert", str(certs["server"].cert),
                             "--tls-key", str(certs["server"].key), "--api-key-file", str(keys),
                             ready="log")
    yield target
    procs.close()


def _tls_channel(target: str, certs) -> grpc.Channel:
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(
        certs["ca"].cert.read_bytes()))


def test_grpcurl_with_cacert_and_a_key(tls_keys, certs):
    ca = str(certs["ca"].cert)
    key = f"authorization: Bearer {KEY_A}"
    health = _grpcurl("-cacert", ca, "-H", key, tls_keys, "grpc.health.v1.Health/Check",
                      data=f'{{"service": "{GENERATION_SERVICE}"}}')
    assert health.returncode == 0 and '"status": "SERVING"' in health.stdout, health.stderr
    listed = _grpcurl("-cacert", ca, "-H", key, tls_keys, "list")
    assert listed.returncode == 0 and GENERATION_SERVICE in listed.stdout, listed.stderr
    hidden = _grpcurl("-cacert", ca, tls_keys, "list")
    assert hidden.returncode != 0 and "Unauthenticated" in hidden.stderr
    out = _grpcurl("-cacert", ca, "-H", key, tls_keys, f"{GENERATION_SERVICE}/Generate",
                   data='{"token_ids": [5, 6, 7], "stopping": {"max_tokens": 3}}')
    assert out.returncode == 0, out.stderr
    msgs = json_stream(out.stdout)
    assert msgs[-1]["finishReason"] == "LENGTH" and msgs[-1]["usage"]["completionTokens"] == 3
    # Plaintext to a TLS port may fail at once or dial until grpcurl's connect timeout (10 s
    # by default; 10.7 s of a full run): 2 s ends the same refusal sooner.
    plaintext = _grpcurl("-connect-timeout", "2", "-plaintext", "-H", key, tls_keys, "list")
    assert plaintext.returncode != 0
    vllm = _grpcurl("-cacert", ca, "-H", key, tls_keys, f"{VLLM_ENGINE_SERVICE}/Generate",
                    data='{"request_id": "g", "tokenized": {"input_ids": [5, 6, 7]}, '
                         '"sampling_params": {"max_tokens": 3}}')
    assert vllm.returncode == 0 and '"finishReason": "length"' in vllm.stdout, vllm.stderr
    keyless = _grpcurl("-cacert", ca, tls_keys, f"{VLLM_ENGINE_SERVICE}/HealthCheck", data="{}")
    assert keyless.returncode != 0 and "Unauthenticated" in keyless.stderr


def test_api_keys_and_abort_by_key(tls_keys, certs):
    with _tls_channel(tls_keys, certs) as ch:
        probe = health_pb2_grpc.HealthStub(ch).Check(   # open without a key, for probes
            health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=30)
        assert probe.status == health_pb2.HealthCheckResponse.SERVING
        stub = generation_stub(ch)
        req = greedy_request([5, 6, 7], 3)
        for metadata in ((), (("authorization", "Bearer not-a-key-0123456789"),),
                         (("authorization", KEY_A),)):
            code, details = _status(lambda: collect(stub.Generate(req, timeout=30,
                                                                  metadata=metadata)))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "--api-key-file" in details
        a, b = (("authorization", f"Bearer {KEY_A}"),), (("authorization", f"Bearer {KEY_B}"),)
        long = greedy_request([9, 8, 7], 1500, "tenant-a-long")
        started, result = threading.Event(), {}

        def run() -> None:
            msgs = []
            for msg in stub.Generate(long, timeout=300, metadata=a):
                msgs.append(msg)
                started.set()
            result["msgs"] = msgs
        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(60)
        other = stub.Abort(pb.AbortRequest(request_ids=["tenant-a-long"]), timeout=30,
                           metadata=b)
        assert other.num_aborted == 0 and thread.is_alive()
        own = stub.Abort(pb.AbortRequest(request_ids=["tenant-a-long"]), timeout=30, metadata=a)
        thread.join(60)
        assert own.num_aborted == 1 and result["msgs"][-1].finish_reason == pb.ABORT


def test_mutual_tls_on_the_public_api(tiny_models, tmp_path, certs):
    procs, target = _cluster(tiny_models, tmp_path, "--tls-cert", str(certs["server"].cert),
                             "--tls-key", str(certs["server"].key), "--tls-client-ca",
                             str(certs["ca"].cert), ready="log")
    try:
        ca = str(certs["ca"].cert)
        # Without a client certificate the handshake never completes: grpcurl dials until its
        # connect timeout (10 s by default), so 2 s ends the same refusal sooner.
        refused = _grpcurl("-connect-timeout", "2", "-cacert", ca, target, "list")
        assert refused.returncode != 0
        client = certs["client"]
        out = _grpcurl("-cacert", ca, "-cert", str(client.cert), "-key", str(client.key),
                       target, f"{GENERATION_SERVICE}/Tokenize", data='{"text": "Hello world"}')
        assert out.returncode == 0 and '"numTokens"' in out.stdout, out.stderr
    finally:
        procs.close()
