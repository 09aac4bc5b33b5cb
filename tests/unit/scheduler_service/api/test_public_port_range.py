"""A public --listen port past 65535 is refused, not bound modulo 65536 as gRPC does."""
from __future__ import annotations

import asyncio

import pytest
from grpc import aio

from scheduler_service.api.api_options import ApiOptions
from scheduler_service.api.public_port import bind


def test_a_listen_port_past_65535_is_refused_not_wrapped_around():
    """gRPC bound 127.0.0.1:99999 as port 34463 (99999 mod 65536) and `serve` announced it
    ready there: an operator's typo served on a port nobody asked for."""
    with pytest.raises(OSError, match=r"could not listen on 127\.0\.0\.1:99999: the port must "
                                      r"be in \[0, 65535\]"):
        asyncio.run(_bind("127.0.0.1:99999"))


async def _bind(listen: str) -> int:
    server = aio.server()
    try:
        return bind(server, listen, ApiOptions())
    finally:
        await server.stop(None)
