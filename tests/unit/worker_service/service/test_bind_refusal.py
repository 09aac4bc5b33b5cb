"""A worker --listen port another process holds: OSError naming the address (the CLI's one line
and exit code 2), not grpc's RuntimeError (a traceback and exit code 1)."""
from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest

from engine_common.security.worker_auth import WorkerAuth
from worker_service.service.auth import add_port


def test_a_port_in_use_is_an_oserror_naming_the_address():
    with socket.socket() as held:          # no SO_REUSEPORT: gRPC cannot share it
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        try:
            with pytest.raises(OSError, match=f"could not listen on {listen}: Failed to bind"):
                add_port(server, listen, WorkerAuth())
        finally:
            server.stop(None)
