"""The Prometheus /metrics endpoint both services serve on a port of their own.

prometheus_client's exposition app, served by a thread-per-connection WSGI server on a daemon
thread; it reads the registry at each scrape, and the services never block on it. Torch-free.

The port is plain HTTP without a key, reachable by whoever the network lets in (the Kubernetes
manifests: every pod), so the server bounds what a connection can hold (docs/security.md):
at most `max_connections` at once (one thread each; a connection past them is closed at once)
and `request_timeout_s` for each read of its request. prometheus_client's own server has
neither: a thread per connection, waiting for its request for ever.
"""
from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, disable_created_metrics, make_wsgi_app

from engine_common.configuration.listen_address import OFF, split_listen

# A scraper holds one connection per scrape; a few scrapers (Prometheus HA pairs, an agent,
# an operator's curl) at once are far under this.
MAX_CONNECTIONS = 32
# Each read of a request (its line, each header); a scraper sends its request at once.
REQUEST_TIMEOUT_S = 10.0


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `max_connections` of them at once."""

    daemon_threads = True            # as prometheus_client's: never joined at close
    request_queue_size = 64          # socketserver's 5 dropped a burst of connections' SYNs

    def __init__(self, address, handler, family: int, max_connections: int):
        self.address_family = family     # read by TCPServer.__init__ to make the socket
        self._lock = threading.Lock()
        self._max, self.num_connections = max_connections, 0
        super().__init__(address, handler)

    def _take(self) -> bool:
        with self._lock:
            if self.num_connections >= self._max:
                return False
            self.num_connections += 1
            return True

    def _give_back(self) -> None:
        with self._lock:
            self.num_connections -= 1

    def process_request(self, request, client_address):
        if not self._take():
            self.shutdown_request(request)      # past the bound: closed, no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_back()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_back()

    def handle_error(self, request, client_address):
        """A client that timed out or went away is not the server's error (socketserver would
        print a traceback to stderr for each)."""


class _QuietHandler(WSGIRequestHandler):
    """Logs nothing (a scrape every few seconds), and gives up on a read after `timeout`."""

    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format, *args):
        pass


def _handler(timeout_s: float) -> type[_QuietHandler]:
    """_QuietHandler giving up on a read after `timeout_s` seconds."""
    return type("_TimedHandler", (_QuietHandler,), {"timeout": timeout_s})


@dataclass
class MetricsServer:
    """A running /metrics endpoint; `port` is the bound port."""

    host: str
    port: int
    _httpd: _BoundedServer

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def num_connections(self) -> int:
        """Connections held now, each on a thread of its own."""
        return self._httpd.num_connections

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics_server(listen: str | None, registry: CollectorRegistry,
                         max_connections: int = MAX_CONNECTIONS,
                         request_timeout_s: float = REQUEST_TIMEOUT_S) -> MetricsServer | None:
    """Serve `registry` at http://HOST:PORT/metrics; None when `listen` is unset or "off".
    A port in use raises OSError naming the address."""
    if listen is None or listen == OFF:
        return None
    disable_created_metrics()   # no *_created series: vLLM exposes none either
    host, port = split_listen(listen)
    try:
        family, address = _family(host, port)
        httpd = make_server(address, port, make_wsgi_app(registry),
                            lambda at, handler: _BoundedServer(at, handler, family,
                                                               max_connections),
                            handler_class=_handler(request_timeout_s))
    except OSError as e:
        raise OSError(f"could not serve metrics on {listen}: {e.strerror or e}") from None
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return MetricsServer(host, httpd.server_port, httpd)


def _family(host: str, port: int) -> tuple[int, str]:
    """The address family and address to bind `host` with (an IPv6 one for `::`, say), as
    prometheus_client's start_http_server picks them."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    return family, sockaddr[0]
