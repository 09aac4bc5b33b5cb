"""One `deltaserve serve` of the real default model for every test of this package (about 10 s a
start on 2 cores): the tests only send requests to it, and each leaves it idle (a cancelled
request is awaited until the server has dropped it). Package scope: it stops after this
package's last test rather than staying up through the rest of the session."""
from __future__ import annotations

import pytest

from tests.support.serve_process import GrpcServe


@pytest.fixture(scope="package")
def served(default_model, tmp_path_factory):
    """The server, with `ready_text`: its output up to the ready line."""
    server = GrpcServe(tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        server.ready_text = server.wait_ready()
        yield server
    finally:
        server.stop()
