"""vLLM's --allowed-origins on the real gateway: `smg_command` gives smg the listed origins as
--cors-allowed-origins, and its CORS preflight then allows a listed origin and no other (as
vLLM's; with the flag unset no origin is allowed, also as vLLM's). No worker is needed for the
preflight: smg answers it itself."""
from __future__ import annotations

import http.client

import pytest

from deltaserve.cli import build_parser
from deltaserve.openai_gateway import gateway_model_path, openai_options, smg_command
from tests.support.gateway import require_smg
from tests.support.grpc_harness import Proc, free_port, wait_for

ALLOW = "access-control-allow-origin"


def _preflight(port: int, origin: str) -> dict[str, str] | None:
    """The preflight's headers (lower-case names), or None while smg is not listening."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        response = conn.getresponse()
        response.read()
        return {k.lower(): v for k, v in response.getheaders()}
    except OSError:
        return None
    finally:
        conn.close()


@pytest.mark.parametrize("flags,allowed", [
    (["--allowed-origins", '["https://ui.example"]'], {"https://ui.example"}),
    ([], set()),
])
def test_the_gateway_allows_exactly_the_origins_of_allowed_origins(
        flags, allowed, tiny_models, tmp_path):
    smg = require_smg()
    port = free_port()
    options, _ = openai_options(build_parser().parse_args(
        ["serve", "--port", str(port), *flags]))
    cmd = smg_command(smg, options, f"127.0.0.1:{free_port()}",
                      gateway_model_path(tiny_models("qwen3")), free_port())
    gateway = Proc("smg", cmd, tmp_path / "smg.log")
    try:
        wait_for(lambda: _preflight(port, "https://ui.example") is not None, 60,
                 "the gateway's port", [gateway])
        for origin in ("https://ui.example", "https://other.example"):
            headers = _preflight(port, origin)
            assert (headers.get(ALLOW) == origin) == (origin in allowed), (origin, headers)
    finally:
        gateway.stop()
