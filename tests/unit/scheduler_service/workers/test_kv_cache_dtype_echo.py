"""Workers echo the KV cache dtype they allocated (InitResponse.kv_cache_dtype, field 9), and
the scheduler's WorkerClient refuses a worker set whose echo is not what Init asked: a build
that ignores Init's kv_cache_dtype (field 23) runs auto, which must not pass for fp8. A real CPU
worker service on loopback (tiny model) and the scheduler's own client; the "old builds" are
the same worker with field 23 dropped on arrival, or its echo dropped from the reply."""
from __future__ import annotations

import contextlib

import pytest

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.security.worker_auth import WorkerAuth
from scheduler_service.workers.init_messages import allocated_kv_cache_dtype
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.init_specs import init_spec
from worker_service.service import servicer as servicer_module
from worker_service.service.server import serve_worker

TOKEN = "test-token-0123456789abcdef"
LIMITS = dict(dtype="float32", block_size=4, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64, kv_cache_bytes=1 << 20)


@contextlib.contextmanager
def _serve():
    """(address, client) of a CPU worker service (its servicer's methods bound now)."""
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"),
                          WorkerAuth(token=TOKEN))
    address = f"127.0.0.1:{server.bound_port}"
    client = WorkerClient([address], connect_timeout_s=60, auth=WorkerAuth(token=TOKEN))
    try:
        yield address, client
    finally:
        client.close()
        server.stop(None)
        server.node_worker.close()


@pytest.fixture
def worker():
    with _serve() as served:
        yield served


@pytest.mark.parametrize("asked,allocated", [("auto", "auto"), ("fp8", "fp8_e5m2"),
                                             ("fp8_e4m3", "fp8_e4m3")])
def test_the_worker_echoes_the_dtype_it_allocated(worker, tiny_models, asked, allocated):
    _, client = worker
    result = client.init(init_spec(tiny_models("llama"), kv_cache_dtype=asked, **LIMITS))
    assert result.kv_cache_dtype == allocated            # CPU: plain fp8 is e5m2


def test_a_worker_that_ignores_the_field_is_refused(worker, tiny_models, monkeypatch):
    """The worker drops Init's field 23, runs auto and says so: fp8 asked, refused by name."""
    address, client = worker
    read = servicer_module.from_proto

    def old_build(cls, message, **extra):
        message.ClearField("kv_cache_dtype")
        return read(cls, message, **extra)
    monkeypatch.setattr(servicer_module, "from_proto", old_build)
    with pytest.raises(ValueError) as refused:
        client.init(init_spec(tiny_models("llama"), kv_cache_dtype="fp8", **LIMITS))
    text = str(refused.value)
    assert f"worker {address}" in text and "kv_cache_dtype='auto'" in text, text
    assert "kv_cache_dtype='fp8' was asked" in text, text


def test_a_worker_that_echoes_nothing_serves_auto_only(tiny_models, monkeypatch):
    """A build before the echo: accepted for auto, refused for fp8 naming the missing echo."""
    init = servicer_module.WorkerServicer.Init

    def no_echo(self, request, context):
        reply = init(self, request, context)
        reply.ClearField("kv_cache_dtype")
        return reply
    monkeypatch.setattr(servicer_module.WorkerServicer, "Init", no_echo)    # before it serves
    model = tiny_models("llama")
    with _serve() as (address, client):
        assert client.init(init_spec(model, **LIMITS)).kv_cache_dtype == "auto"
        with pytest.raises(ValueError,
                           match=f"worker {address} .*'fp8_e4m3' was asked.*echoed none"):
            client.init(init_spec(model, kv_cache_dtype="fp8_e4m3", **LIMITS))


def test_nodes_that_resolve_fp8_differently_are_refused():
    """fp8 is e4m3 on CUDA and e5m2 on the CPU: a mixed set would attend in two precisions."""
    assert allocated_kv_cache_dtype("fp8", [("a:1", "fp8_e4m3"), ("b:1", "fp8_e4m3")]) \
        == "fp8_e4m3"
    with pytest.raises(ValueError, match="a:1 'fp8_e4m3', b:1 'fp8_e5m2'"):
        allocated_kv_cache_dtype("fp8", [("a:1", "fp8_e4m3"), ("b:1", "fp8_e5m2")])
    with pytest.raises(ValueError, match="worker b:1 allocated a kv_cache_dtype='fp8_e5m2'"):
        allocated_kv_cache_dtype("fp8_e4m3", [("a:1", "fp8_e4m3"), ("b:1", "fp8_e5m2")])
