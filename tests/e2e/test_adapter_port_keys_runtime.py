"""An adapter's own VllmEngine port (--lora-engine-listen) behind --api-key-file, with the adapter
loaded, unloaded and loaded again at run time (docs/lora.md): the port asks for a key as the main
port does; before the load and after the unload its Generate is NOT_FOUND naming the adapter;
loaded, it gives the adapter's tokens (transformers + peft); loaded again from another directory,
that directory's tokens with no prefix-cache hit on the old adapter's blocks. A real scheduler
and CPU worker over loopback."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.grpc_harness import free_port, generation_stub, scheduler_and_worker
from tests.support.lora_adapters import make_adapter, peft_greedy
from tests.support.vllm_sim import rpc_code

ADMIN, TENANT = "port-key-admin-0123456789", "port-key-tenant-012345678"
PROMPT = tuple(range(11, 51))      # 40 tokens: two full 16-token blocks
MAX_NEW = 6


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """(main channel, adapter port channel, model, root)."""
    model = tiny_models("llama")
    root = tmp_path_factory.mktemp("adapter-port")
    (root / "logs").mkdir()
    keys = root / "keys"
    keys.write_text(f"{ADMIN} admin\n{TENANT}\n")
    port = free_port()
    flags = ["--enable-lora", "--allow-runtime-lora-updating", "--max-lora-rank", "8",
             "--dtype", "float32", "--api-key-file", str(keys),
             "--lora-engine-listen", f"sql=127.0.0.1:{port}"]
    with scheduler_and_worker(model, root / "logs", scheduler_args=flags) as (target, _):
        with grpc.insecure_channel(target) as main, \
                grpc.insecure_channel(f"127.0.0.1:{port}") as adapter:
            yield main, adapter, model, root


def _as(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def _generate(channel, key: str = TENANT):
    """(output ids, cached tokens) of a greedy Generate on a VllmEngine port."""
    request = vpb.GenerateRequest(
        request_id="r", tokenized=vpb.TokenizedInput(input_ids=list(PROMPT)),
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                           ignore_eos=True))
    msgs = list(vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
        request, timeout=60, metadata=_as(key)))
    complete = msgs[-1].complete
    return list(complete.output_ids), complete.cached_tokens


def _load(main, name: str, path: str) -> None:
    generation_stub(main).LoadLoraAdapter(pb.LoadLoraAdapterRequest(
        lora_name=name, lora_path=path), timeout=60, metadata=_as(ADMIN))


def test_the_port_asks_for_a_key_and_follows_loads_and_unloads(served):
    main, adapter, model, root = served
    stub = vllm_engine_pb2_grpc.VllmEngineStub(adapter)
    code, _ = rpc_code(lambda: stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    info = stub.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10, metadata=_as(TENANT))
    assert info.served_model_name == "sql"

    code, details = rpc_code(lambda: _generate(adapter))      # not loaded yet
    assert code == grpc.StatusCode.NOT_FOUND and "sql" in details, details

    sql = make_adapter(model, root / "sql", r=8, alpha=32, seed=1)
    chat = make_adapter(model, root / "chat", r=4, alpha=8, seed=2)
    _load(main, "sql", sql)
    first, cached = _generate(adapter)
    assert first == list(peft_greedy(model, sql, PROMPT, MAX_NEW).token_ids) and cached == 0
    assert _generate(adapter)[1] == 32                       # its own blocks are shared

    generation_stub(main).UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name="sql"),
                                            timeout=60, metadata=_as(ADMIN))
    code, details = rpc_code(lambda: _generate(adapter))
    assert code == grpc.StatusCode.NOT_FOUND and "sql" in details, details

    _load(main, "sql", chat)          # the same name from another directory
    again, cached = _generate(adapter)
    assert cached == 0, "a block of the unloaded adapter was hit"
    assert again == list(peft_greedy(model, chat, PROMPT, MAX_NEW).token_ids) != first
    # the base model's port is not the adapter's
    base, _ = _generate(main)
    assert base == list(peft_greedy(model, None, PROMPT, MAX_NEW).token_ids) != again
