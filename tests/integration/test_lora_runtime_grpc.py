"""LoRA adapters loaded and unloaded at run time over gRPC (docs/lora.md, "Loading at run
time"): a scheduler started with --enable-lora --allow-runtime-lora-updating and a separate CPU
worker process, with one rank, and with two rank processes (--local-ranks 2, every step's
symmetry verified). LoadLoraAdapter answers once every rank holds the adapter (tokens ==
transformers + peft); refusals name the field or path and the reason and load nothing; a
request running when its adapter is unloaded finishes with it; later ones get NOT_FOUND; the
name loaded again from another directory gives that directory's tokens and no stale
prefix-cache hit."""
from __future__ import annotations

import re

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as pb
from tests.support.grpc_harness import (collect, generation_stub, greedy_request,
                                        scheduler_and_worker)
from tests.support.lora_adapters import bad_adapters, make_adapter, peft_greedy

MAX_NEW = 8
MAX_RANK = 8
# 40 tokens: two full 16-token blocks the prefix cache can hit.
PROMPT = (11, 40, 7, 93, 5, 120, 64, 3, 77, 18, 25, 60, 31, 99, 140, 12, 9, 44, 81, 6,
          73, 150, 2, 58, 36, 101, 17, 88, 49, 130, 21, 67, 14, 110, 39, 95, 8, 52, 160, 27)
TP2 = ["--local-ranks", "2", "--dist-timeout", "60", "--rank-step-timeout", "60"]


# One rank with two steps in flight (a load or unload first collects them), and two rank
# processes.
@pytest.fixture(scope="module", params=[
    pytest.param(([], ["--async-scheduling"]), id="tp1-async"),
    pytest.param((TP2, []), id="tp2", marks=pytest.mark.slow)])
def served(request, tiny_models, tmp_path_factory):
    """(stub, model, adapters dir) of a running scheduler and worker."""
    worker_args, more = request.param
    model = tiny_models("llama")
    root = tmp_path_factory.mktemp("lora-grpc")
    (root / "logs").mkdir()
    flags = ["--enable-lora", "--allow-runtime-lora-updating", "--max-lora-rank",
             str(MAX_RANK), "--verify-symmetry", "--dtype", "float32", *more]
    with scheduler_and_worker(model, root / "logs", scheduler_args=flags,
                              worker_args=worker_args) as (target, _):
        with grpc.insecure_channel(target) as channel:
            yield generation_stub(channel), model, root


def _generate(stub, name: str, max_new: int = MAX_NEW) -> tuple[list[int], int]:
    request = greedy_request(PROMPT, max_new)
    request.lora_name = name
    ids, _, msgs = collect(stub.Generate(request))
    return ids, msgs[-1].usage.cached_prompt_tokens


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def _names(stub) -> list[tuple[str, int]]:
    return [(a.lora_name, a.lora_id) for a in
            stub.ListLoraAdapters(pb.ListLoraAdaptersRequest()).adapters]


def test_refusals_name_the_field_and_load_nothing(served, tmp_path):
    stub, model, _ = served
    for case, (path, reason) in bad_adapters(model, tmp_path, MAX_RANK).items():
        details = _refused(lambda: stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
            lora_name="bad", lora_path=path)), grpc.StatusCode.INVALID_ARGUMENT)
        assert f"lora_path={path!r} is invalid" in details, case
        assert re.search(reason, details), (case, details)
    assert _names(stub) == []
    details = _refused(lambda: stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
        lora_name="a b", lora_path="/x")), grpc.StatusCode.INVALID_ARGUMENT)
    assert "lora_name='a b' is invalid" in details
    details = _refused(lambda: stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(
        lora_name="nope")), grpc.StatusCode.NOT_FOUND)
    assert "lora_name='nope' is invalid: must be a served LoRA adapter" in details


def test_load_unload_while_running_reload(served):
    stub, model, root = served
    sql = make_adapter(model, root / "sql", r=8, alpha=32, seed=1)
    chat = make_adapter(model, root / "chat", r=4, alpha=8, seed=2,
                        targets=("q_proj", "v_proj", "down_proj"))
    reply = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="sql", lora_path=sql))
    assert reply.lora_id == 1 and _names(stub) == [("sql", 1)]
    first, _ = _generate(stub, "sql")
    assert first == list(peft_greedy(model, sql, PROMPT, MAX_NEW).token_ids)
    details = _refused(lambda: stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(
        lora_name="sql", lora_path=chat)), grpc.StatusCode.ALREADY_EXISTS)
    assert "lora_name='sql' is invalid" in details

    # Unloaded while a request runs with it: that request finishes with it (vLLM's way).
    request = greedy_request(PROMPT, 24)
    request.lora_name = "sql"
    stream = stub.Generate(request)
    head = next(stream)
    stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="sql"))
    rest, _, _ = collect(stream)
    assert list(head.token_ids) + rest == list(peft_greedy(model, sql, PROMPT, 24).token_ids)
    details = _refused(lambda: _generate(stub, "sql"), grpc.StatusCode.NOT_FOUND)
    assert "lora_name='sql' is invalid: must be a served LoRA adapter" in details

    # The same name (and id) from another directory: its tokens, no block of the old one.
    reply = stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="sql", lora_path=chat))
    assert reply.lora_id == 1
    again, cached = _generate(stub, "sql")
    assert cached == 0
    assert again == list(peft_greedy(model, chat, PROMPT, MAX_NEW).token_ids) != first
    assert _generate(stub, "sql")[1] == 32           # its own blocks are shared
