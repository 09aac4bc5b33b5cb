"""Worker.LoadLora / UnloadLora (docs/protocols/worker.md) on a real worker service over
loopback with the tiny Llama: the owner's calls only, in its epoch, with its stream key; a
lora_id out of range, a path outside --model-root and a worker Inited without
allow_runtime_lora_updating are refused naming the field, the value or the setting; a load and
an unload on the one rank change its slots."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.security.worker_auth import WorkerAuth
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from tests.support.grpc_harness import bearer, keyed
from tests.support.lora_adapters import make_adapter
from worker_service.service.server import serve_worker

TOKEN = "test-token-0123456789abcdef"
LIMITS = dict(dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, kv_cache_bytes=1 << 20, enable_lora=True,
              max_lora_rank=8)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def server(model):
    root = str(Path(model).parent)       # the models' folder: adapters go under it
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu", model_root=root),
                          WorkerAuth(token=TOKEN))
    try:
        yield server
    finally:
        server.stop(None)
        server.node_worker.close()


def _init(server, model, allow: bool):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.bound_port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    epoch = server.node_worker.fence.epoch + 1
    config = worker_pb2.WorkerConfig(model_dir=model, allow_runtime_lora_updating=allow,
                                     **LIMITS)
    reply = stub.Init(worker_pb2.InitRequest(epoch=epoch, scheduler_id="owner", config=config),
                      timeout=120, metadata=bearer(TOKEN))
    return channel, stub, keyed(TOKEN, reply.stream_key), epoch


def _linked_adapter(adapter: str, outside: str, name: str) -> str:
    """A copy of `adapter` (under the model root) whose file `name` is a symlink to that file
    of `outside` (not under it)."""
    linked = Path(adapter).parent / f"linked-{name}"
    linked.mkdir()
    for f in Path(adapter).iterdir():
        (linked / f.name).symlink_to(Path(outside, f.name) if f.name == name else f)
    return str(linked)


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def test_owner_only_and_refusals(server, model, tmp_path):
    adapter = make_adapter(model, Path(model).parent / "lora-a", r=4, alpha=8)
    outside = make_adapter(model, tmp_path / "outside", r=4, alpha=8)
    channel, stub, meta, epoch = _init(server, model, allow=True)
    with channel:
        def load(lora_id=1, path=adapter, owner="owner", at=epoch, metadata=meta):
            return stub.LoadLora(worker_pb2.LoadLoraRequest(
                epoch=at, scheduler_id=owner, lora_id=lora_id, name="a", path=path),
                timeout=60, metadata=metadata)

        assert "LoadLora refused: it carries no stream key" in _refused(
            lambda: load(metadata=bearer(TOKEN)), grpc.StatusCode.PERMISSION_DENIED)
        assert "scheduler other does not own this worker" in _refused(
            lambda: load(owner="other"), grpc.StatusCode.FAILED_PRECONDITION)
        assert f"epoch={epoch + 1} is invalid: must be the current epoch {epoch}" in _refused(
            lambda: load(at=epoch + 1), grpc.StatusCode.FAILED_PRECONDITION)
        assert "lora_id=0 is invalid: must be in [1, 1024]" in _refused(
            lambda: load(lora_id=0), grpc.StatusCode.INVALID_ARGUMENT)
        assert (f"lora_path={outside!r} is invalid: must be under this worker's --model-root"
                in _refused(lambda: load(path=outside), grpc.StatusCode.INVALID_ARGUMENT))
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            linked = _linked_adapter(adapter, outside, name)   # under the root, one file not
            assert (f"lora_path={linked!r} is invalid: {name} resolves to "
                    f"{Path(outside, name).resolve()}: must be under this worker's "
                    "--model-root" in _refused(lambda: load(path=linked),
                                               grpc.StatusCode.INVALID_ARGUMENT))
        slots = server.node_worker.ranks.runner.lora
        assert slots.adapters == {}
        load(lora_id=3)
        assert sorted(slots.adapters) == [2]
        stub.UnloadLora(worker_pb2.UnloadLoraRequest(epoch=epoch, scheduler_id="owner",
                                                     lora_id=3), timeout=60, metadata=meta)
        assert slots.adapters == {}

    channel, stub, meta, epoch = _init(server, model, allow=False)
    with channel:
        details = _refused(lambda: stub.LoadLora(worker_pb2.LoadLoraRequest(
            epoch=epoch, scheduler_id="owner", lora_id=1, name="a", path=adapter),
            timeout=60, metadata=meta), grpc.StatusCode.FAILED_PRECONDITION)
        assert "allow_runtime_lora_updating=false in this worker's Init" in details


def test_init_refuses_lora_modules_outside_the_model_root(server, model, tmp_path):
    outside = make_adapter(model, tmp_path / "outside", r=4, alpha=8)
    with grpc.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
        config = worker_pb2.WorkerConfig(model_dir=model, lora_modules=f"x={outside}", **LIMITS)
        details = _refused(lambda: worker_pb2_grpc.WorkerStub(channel).Init(
            worker_pb2.InitRequest(epoch=server.node_worker.fence.epoch + 1,
                                   scheduler_id="owner", config=config),
            timeout=60, metadata=bearer(TOKEN)), grpc.StatusCode.INVALID_ARGUMENT)
    assert f"lora_path={outside!r} is invalid: must be under this worker's --model-root" \
        in details
