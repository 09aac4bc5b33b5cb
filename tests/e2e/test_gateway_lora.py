"""A LoRA adapter picked by OpenAI's `model` through the real Shepherd Model Gateway (smg 1.13.0)
(docs/lora.md, "Through the gateway"). The gateway routes by `model` to a worker that registered
that name and sends the engine no adapter field, so the adapter has a VllmEngine port of its own
(--lora-engine-listen) whose GetModelInfo names it: `/v1/completions` with model="sql" gives the
text deltaserve.v1 Generate gives with lora_name="sql"; the base model's name gives the base
model's text; a name no port registered is the gateway's 404."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as pb
from tests.support.gateway import Gateway, Replica, http_json, require_smg
from tests.support.grpc_harness import Processes, collect, free_port, generation_stub
from tests.support.lora_adapters import make_adapter

PROMPT = "the quick brown fox"
MAX_NEW = 8


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """(gateway, replica, base model name) with adapter `sql` on a port of its own."""
    smg = require_smg()
    model = tiny_models("llama")
    root = tmp_path_factory.mktemp("gateway-lora")
    sql = make_adapter(model, root / "sql", r=8, alpha=32, seed=1)
    procs = Processes(root)
    sql_port = free_port()
    try:
        replica = Replica(procs, model, "--enable-lora", "--lora-modules", f"sql={sql}",
                          "--max-lora-rank", "8", "--dtype", "float32",
                          "--lora-engine-listen", f"sql=127.0.0.1:{sql_port}")
        gateway = Gateway(smg, [replica.url, f"grpc://127.0.0.1:{sql_port}"], model, root)
        try:
            gateway.wait_healthy(2, procs=[replica.worker, replica.scheduler])
            yield gateway, replica, model.rstrip("/").rsplit("/", 1)[-1]
        finally:
            gateway.close()
    finally:
        procs.close()


def _generate_text(replica, lora_name: str) -> str:
    request = pb.GenerateRequest(text=PROMPT, lora_name=lora_name, stopping=pb.StoppingCriteria(
        max_tokens=MAX_NEW, ignore_eos=True))
    with grpc.insecure_channel(replica.target) as channel:
        return collect(generation_stub(channel).Generate(request, timeout=60))[1]


def _completion(gateway, model: str) -> tuple[int, dict]:
    return http_json(gateway.port, "POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0,
        "ignore_eos": True})


def test_openai_model_names_the_adapter(served):
    gateway, replica, base = served
    listed = {m["id"] for m in http_json(gateway.port, "GET", "/v1/models")[1]["data"]}
    assert listed == {base, "sql"}
    status, sql = _completion(gateway, "sql")
    assert status == 200, sql
    assert sql["choices"][0]["text"] == _generate_text(replica, "sql") != ""
    status, plain = _completion(gateway, base)
    assert status == 200, plain
    assert plain["choices"][0]["text"] == _generate_text(replica, "")
    assert plain["choices"][0]["text"] != sql["choices"][0]["text"]
    status, missing = _completion(gateway, "chat")
    assert status == 404 and missing["error"]["code"] == "model_not_found"
