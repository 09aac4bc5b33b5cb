"""With --api-key-file, the public port's health Check stays open (probes), but Watch needs a
key, as every streaming method of the worker's port needs its token.

Session 48 (anyone on the network): every grpc.health.v1 method was open, and a Watch is a
stream the server holds while the client keeps it open: one client with no key opened 3,000
of them on one connection and the scheduler's memory grew by 63 MB (38 -> 101 MB; about 21 KB
a stream, this 2-core AMD EPYC Zen 4), with no bound on their number. Kubernetes' gRPC probes
and grpc-health-probe call Check."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_service.api import public_port
from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.health import Readiness

KEY = "health-key-0123456789abcdef"
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def health(tmp_path):
    """A public port (the real interceptors, keys on) serving the real readiness servicer."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    api = ApiOptions(api_key_file=str(keys))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    held = []

    async def start() -> int:
        server = grpc.aio.server(options=public_port.port_options(api),
                                 interceptors=public_port.interceptors(
                                     api, public_port.api_keys(api)))
        readiness = Readiness("deltaserve.v1.Generation", lambda: True)
        readiness.add_to_server(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await readiness.start()
        held.extend((server, readiness))
        return port

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield health_pb2_grpc.HealthStub(channel)
    asyncio.run_coroutine_threadsafe(held[0].stop(None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def test_check_is_open_and_watch_needs_a_key(health):
    request = health_pb2.HealthCheckRequest(service="")
    assert health.Check(request, timeout=30).status == SERVING          # probes: no key
    with pytest.raises(grpc.RpcError) as refused:
        next(health.Watch(request, timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "--api-key-file" in refused.value.details()
    watch = health.Watch(request, timeout=30,
                         metadata=(("authorization", f"Bearer {KEY}"),))
    assert next(watch).status == SERVING
    watch.cancel()
