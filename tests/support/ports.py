"""Loopback ports for test servers."""
from __future__ import annotations

import socket

# Ports this process has handed out. The kernel may offer the same ephemeral port to two binds
# in a row once the first socket is closed, so two calls for one command line (--listen and
# --worker-listen) could otherwise collide.
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before by this process."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
