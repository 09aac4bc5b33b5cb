"""A real CPU worker service in this process, on a loopback port, for tests of its RPCs."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.security.worker_auth import WorkerAuth
from worker_service.service.server import serve_worker


@contextlib.contextmanager
def cpu_worker(token: str) -> Iterator[str]:
    """The worker's HOST:PORT (callers authenticate with `token`); stopped and closed after."""
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"),
                          WorkerAuth(token=token))
    try:
        yield f"127.0.0.1:{server.bound_port}"
    finally:
        server.stop(None)
        server.node_worker.close()
