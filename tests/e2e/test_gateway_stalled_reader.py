"""An OpenAI client behind the real gateway (smg 1.13.0) that stops reading its streamed answer:
what --stream-send-timeout does there (found in review, session 46). The gateway reads our
Generate stream as fast as we send it, whatever its own client reads, and keeps what it has not
yet written to that client: so the stream's reader never stalls, our timeout never fires, and
the request runs to its end while the HTTP client has read nothing; the output is held by the
gateway instead (about 1 KB a token with 20 top logprobs as SSE), until the client reads it or
goes away. The client then gets the whole answer. The bound on a stalled HTTP client's memory is
the gateway's (and --max-requests-per-key's on how many answers a key runs at once), not ours.

Skipped, with the reason, when the `smg` binary cannot run here."""
from __future__ import annotations

import json
import os
import socket

import pytest

from tests.support.gateway import Gateway, Replica, chat_model_dir, require_smg
from tests.support.grpc_harness import REPO, Processes, wait_for
from tests.support.metrics_scrape import scrape

pytestmark = pytest.mark.slow

MAX_TOKENS = 1900          # the tiny model's 2,048 positions, less the chat prompt


@pytest.fixture(scope="module")
def single(tiny_models, tmp_path_factory):
    smg = require_smg()
    log_dir = tmp_path_factory.mktemp("gateway-stalled")
    model = chat_model_dir(tiny_models("qwen3"), log_dir / "tiny-chat")
    procs = Processes(log_dir)
    gateway = None
    try:
        replica = Replica(procs, os.path.relpath(model, REPO), "--stream-send-timeout", "1")
        gateway = Gateway(smg, [replica.url], "tiny-chat", log_dir)
        gateway.wait_healthy(1, procs=[replica.worker, replica.scheduler])
        yield replica, gateway
    finally:
        if gateway is not None:
            gateway.close()
        procs.close()


def _stalled_client(port: int) -> socket.socket:
    """A streamed chat completion sent on a socket with a 4 KB receive buffer, not read."""
    body = json.dumps({"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                       "logprobs": True, "top_logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):          # the chunked body's end
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


def test_a_stalled_client_behind_the_gateway_is_buffered_by_the_gateway_not_cut(single):
    replica, gateway = single

    def finished() -> float:
        return sum(v for (name, labels), v in scrape(replica.metrics_port).samples.items()
                   if name == "deltaserve:request_success_total"
                   and dict(labels).get("finished_reason") == "length")

    before = finished()
    with _stalled_client(gateway.port) as sock:
        # our stream ran to its end (each write taken at once) while the client read nothing
        # 1,900 tokens with 20 top logprobs each: ~20 s on a quiet 2-core machine, 122 s seen
        # under a load average of 10; the wait only guards against a hang
        wait_for(lambda: finished() == before + 1, 600, "the stalled client's request to end",
                 [replica.scheduler, gateway.proc])
        got = scrape(replica.metrics_port)
        assert "deltaserve:streams_stalled_total" in got.names
        assert got.get("deltaserve:streams_stalled_total", model_name="tiny-chat") == 0
        data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 200 OK")
    assert b'"finish_reason":"length"' in data and b"data: [DONE]" in data
    # the whole answer waited at the gateway: far more than any socket buffer holds
    assert len(data) > 1_000_000
