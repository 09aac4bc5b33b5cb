"""The Prometheus /metrics endpoint both services serve on a port of their own.

prometheus_client's exposition server runs on a daemon thread and reads the registry at each
scrape; the services never block on it. Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

from engine_common.configuration.listen_address import OFF, split_listen


@dataclass
class MetricsServer:
    """A running /metrics endpoint; `port` is the bound port."""

    host: str
    port: int
    _httpd: object

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics_server(listen: str | None, registry: CollectorRegistry) -> MetricsServer | None:
    """Serve `registry` at http://HOST:PORT/metrics; None when `listen` is unset or "off".
    A port in use raises OSError naming the address."""
    if listen is None or listen == OFF:
        return None
    disable_created_metrics()   # no *_created series: vLLM exposes none either
    host, port = split_listen(listen)
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"could not serve metrics on {listen}: {e.strerror or e}") from None
    return MetricsServer(host, httpd.server_port, httpd)
