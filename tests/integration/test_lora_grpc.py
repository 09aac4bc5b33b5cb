"""LoRA over gRPC (docs/lora.md): a scheduler and a separate CPU worker process started with
--enable-lora --lora-modules; Generate's lora_name picks the adapter (tokens == transformers +
peft), an unknown name is NOT_FOUND naming the field, the value and the served names, and
without --allow-runtime-lora-updating LoadLoraAdapter is FAILED_PRECONDITION naming the flag."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as pb
from tests.support.grpc_harness import (collect, generation_stub, greedy_request,
                                        scheduler_and_worker)
from tests.support.lora_adapters import make_adapter, peft_greedy

PROMPT = (11, 40, 7, 93, 5, 120, 64, 3, 77)


def test_generate_names_an_adapter(tiny_models, tmp_path):
    model = tiny_models("llama")
    sql = make_adapter(model, tmp_path / "sql", r=8, alpha=32, seed=1)
    (tmp_path / "logs").mkdir()
    flags = ["--enable-lora", "--lora-modules", f"sql={sql}", "--max-lora-rank", "8"]
    with scheduler_and_worker(model, tmp_path / "logs", scheduler_args=flags) as (target, _):
        with grpc.insecure_channel(target) as ch:
            stub = generation_stub(ch)
            request = greedy_request(PROMPT, 8)
            base, _, _ = collect(stub.Generate(request))
            request.lora_name = "sql"
            adapted, _, _ = collect(stub.Generate(request))
            request.lora_name = "nope"
            with pytest.raises(grpc.RpcError) as err:
                collect(stub.Generate(request))
            with pytest.raises(grpc.RpcError) as off:
                stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(lora_name="x", lora_path=sql))
            served = [a.lora_name for a in
                      stub.ListLoraAdapters(pb.ListLoraAdaptersRequest()).adapters]
    assert base == list(peft_greedy(model, None, PROMPT, 8).token_ids)
    assert adapted == list(peft_greedy(model, sql, PROMPT, 8).token_ids)
    assert adapted != base
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "lora_name='nope'" in err.value.details() and "['sql']" in err.value.details()
    assert off.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--allow-runtime-lora-updating" in off.value.details()
    assert served == ["sql"]
