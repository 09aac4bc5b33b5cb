"""The /metrics listener holds a bounded number of connections, each for a bounded time.

Session 48 (anyone who reaches the port: the Kubernetes manifests bind 0.0.0.0:9400 and leave it
open to every pod): prometheus_client's server starts a thread per connection and waits for
its request without a timeout, so idle connections each held a thread of the scheduler's (or
worker's) process for as long as they stayed open, without bound (docs/security.md has the
measurement). Now a connection that sends no request within the timeout is closed, and beyond
the bound a connection is closed at once; the listener serves the scrape after them."""
from __future__ import annotations

import socket
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from engine_common.runtime.metrics_http import start_metrics_server
from tests.support.vllm_sim import wait_until

# Long enough that a failing listener shows as a timeout here, not as a hang of the suite.
_CLIENT_WAIT_S = 30


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("deltaserve:probe", "a test series", registry=registry).inc()
    return registry


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes `sock` (EOF) before the client gives up waiting."""
    sock.settimeout(_CLIENT_WAIT_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _scrape(server) -> str:
    with urllib.request.urlopen(f"http://{server.address}/metrics",
                                timeout=_CLIENT_WAIT_S) as reply:
        return reply.read().decode()


def test_an_idle_connection_is_closed_after_the_request_timeout():
    server = start_metrics_server("127.0.0.1:0", _registry(), request_timeout_s=0.3)
    try:
        idle = socket.create_connection(("127.0.0.1", server.port))
        assert _closed_by_server(idle)            # before: held open (and a thread) for ever
        idle.close()
        assert "deltaserve:probe_total 1.0" in _scrape(server)
    finally:
        server.stop()


def test_connections_past_the_bound_are_closed_at_once():
    server = start_metrics_server("127.0.0.1:0", _registry(), max_connections=4,
                                  request_timeout_s=_CLIENT_WAIT_S * 2)
    try:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        extra = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
        assert all(_closed_by_server(s) for s in extra)
        assert server.num_connections == 4
        for s in held + extra:
            s.close()
        # each held thread sees its client's end, then gives its place back
        wait_until(lambda: server.num_connections == 0, "the closed connections' places")
        assert "deltaserve:probe_total 1.0" in _scrape(server)
    finally:
        server.stop()
