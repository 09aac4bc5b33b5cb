"""vLLM's --served-model-name NAME ALIAS ... and --api-key KEY KEY ... on the real gateway:
`smg_command` from the parsed flags in front of a real replica. Every alias is served and
answered under the first name (as vLLM answers), an unknown name is refused (404); every key
is admitted, another key and none are refused (401)."""
from __future__ import annotations

import http.client
import json

from deltaserve.cli import build_parser
from deltaserve.openai_gateway import openai_options, smg_command
from tests.support.gateway import Replica, chat_model_dir, require_smg
from tests.support.grpc_harness import Proc, Processes, free_port, wait_for

KEYS = ("key-one", "key:two", "key-three")


def _post(port: int, model: str, key: str | None) -> tuple[int, dict]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": "hi", "max_tokens": 2}), headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        conn.close()


def _ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/readiness", headers={"authorization": f"Bearer {KEYS[0]}"})
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def test_the_gateway_serves_every_alias_and_admits_every_key(tiny_models, tmp_path):
    smg = require_smg()
    model = chat_model_dir(tiny_models("qwen3"), tmp_path / "chat")
    port = free_port()
    options, _ = openai_options(build_parser().parse_args(
        ["serve", "--port", str(port), "--served-model-name", "alpha", "beta", "gamma",
         "--api-key", *KEYS]))
    procs = Processes(tmp_path)
    gateway = None
    try:
        replica = Replica(procs, str(model), "--served-model-name", "alpha")
        gateway = Proc("smg", smg_command(smg, options, replica.target, str(model),
                                          free_port()), tmp_path / "smg.log")
        wait_for(lambda: _ready(port), 120, "the gateway's readiness", [gateway, *procs.procs])
        for name in ("alpha", "beta", "gamma"):
            for key in KEYS:
                status, body = _post(port, name, key)
                assert (status, body.get("model")) == (200, "alpha"), (name, key, body)
        assert _post(port, "delta", KEYS[0])[0] == 404
        for key in ("key-four", "key", None):
            assert _post(port, "beta", key)[0] == 401, key
    finally:
        if gateway is not None:
            gateway.stop()
        procs.close()
