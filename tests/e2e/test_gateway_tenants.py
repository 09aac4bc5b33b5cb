"""What the gateway tells a replica of its tenants: nothing (smg 1.13.0).

smg's `--tenant-api-key TENANT:KEY` resolves each key to a tenant of its own, which could let a
replica salt its prefix cache and bound requests per tenant, as our `--api-key-file` keys do.
Here the real gateway, with an `--api-key` and two tenants, fronts a real replica through a
pass-through that records every call (tests/support/recording_proxy.py); requests by each key,
one with a forged `x-smg-tenant-id` header, each with the OpenAI `user` field, all reach our
VllmEngine `Generate` alike: no metadata but `user-agent`, no request field but the prompt, the
sampling parameters and a random request id, no key. If this starts failing because smg sends a
tenant identity, docs/security.md ("smg's tenants do not reach us") says how it could be used
and the trust rule it needs."""
from __future__ import annotations

import http.client
import json
import os

from engine_common.wire.protos import vllm_engine_pb2 as vpb
from tests.support.gateway import Gateway, Replica, require_smg
from tests.support.grpc_harness import REPO, Processes, wait_for
from tests.support.recording_proxy import RecordingProxy

ADMIN = "gateway-key-5d0c2b7e9a41"
TENANTS = {"tenant-a": "tenant-a-key-83f1c6d2e0b7", "tenant-b": "tenant-b-key-19e4a7c3f5d8"}
GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


def _post(port: int, path: str, key: str, body: dict | None = None,
          headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST" if body is not None else "GET", path,
                     None if body is None else json.dumps(body),
                     {"content-type": "application/json", "authorization": f"Bearer {key}",
                      **(headers or {})})
        reply = conn.getresponse()
        return reply.status, reply.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def test_the_gateway_sends_no_tenant_identity_to_a_replica(tiny_models, tmp_path):
    smg = require_smg()
    model = tiny_models("qwen3")
    procs = Processes(tmp_path)
    proxy = gateway = None
    try:
        replica = Replica(procs, os.path.relpath(model, REPO))
        proxy = RecordingProxy(replica.target)
        tenant_flags = [f for name, key in TENANTS.items()
                        for f in ("--tenant-api-key", f"{name}:{key}")]
        gateway = Gateway(smg, [f"grpc://{proxy.address}"], model, tmp_path,
                          "--api-key", ADMIN, *tenant_flags)
        wait_for(lambda: _post(gateway.port, "/readiness", ADMIN)[0] == 200, 120,
                 "a ready gateway", [gateway.proc, *procs.procs])
        senders = [(ADMIN, {}), *((key, {}) for key in TENANTS.values()),
                   (TENANTS["tenant-a"], {"x-smg-tenant-id": "forged-tenant"})]
        for i, (key, headers) in enumerate(senders):
            body = {"model": os.path.basename(model), "prompt": "hello there", "max_tokens": 2,
                    "user": f"user-field-{i}"}
            status, reply = _post(gateway.port, "/v1/completions", key, body, headers)
            assert status == 200, reply
        generates = [c for c in proxy.calls if c.method == GENERATE]
        assert len(generates) >= len(senders), [c.method for c in proxy.calls]
        for call in proxy.calls:
            assert {k for k, _ in call.metadata} <= {"user-agent"}, (call.method, call.metadata)
        secrets = [ADMIN, *TENANTS.values(), *TENANTS, "forged-tenant", "user-field"]
        for call in generates:
            request = vpb.GenerateRequest.FromString(call.request)
            assert {f.name for f, _ in request.ListFields()} == {
                "request_id", "tokenized", "sampling_params"}, request
            assert not any(s.encode() in call.request for s in secrets), request
    finally:
        for thing in (gateway, proxy):
            if thing is not None:
                thing.close()
        procs.close()
