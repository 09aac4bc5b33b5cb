"""The Prometheus listeners bind where they are told, loopback by default under `serve`, and are
separate from the gRPC ports: plain HTTP, no API key, read only (docs/security.md)."""
from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter

from deltaserve.cli import build_parser
from engine_common.configuration.config import WorkerServiceOptions
from engine_common.configuration.listen_address import next_port, split_listen
from engine_common.runtime.metrics_http import start_metrics_server
from scheduler_service.api.server import ServerOptions


def test_a_loopback_listener_binds_loopback_only_and_serves_without_a_key():
    registry = CollectorRegistry()
    Counter("deltaserve:probe", "a test series", registry=registry).inc()
    server = start_metrics_server("127.0.0.1:0", registry)
    try:
        assert server._httpd.socket.getsockname()[0] == "127.0.0.1"   # not 0.0.0.0
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10) as reply:
            body = reply.read().decode()
        assert "deltaserve:probe_total 1.0" in body
    finally:
        server.stop()
    assert start_metrics_server("off", registry) is None
    assert start_metrics_server(None, registry) is None


def test_serve_binds_its_metrics_to_loopback_and_the_services_bind_none_by_default():
    parser = build_parser()
    serve = parser.parse_args(["serve"])
    assert split_listen(serve.metrics_listen)[0] == "127.0.0.1"
    assert serve.worker_metrics_listen is None            # the next port, same host
    assert split_listen(next_port(serve.metrics_listen))[0] == "127.0.0.1"
    assert ServerOptions().metrics_listen is None           # deltaserve scheduler
    assert WorkerServiceOptions().metrics_listen is None    # deltaserve worker
