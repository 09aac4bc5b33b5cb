"""LoadLoraAdapter / UnloadLoraAdapter are the operator's (docs/security.md): with
--api-key-file a key without `admin` is PERMISSION_DENIED before the handler runs, an admin key
reaches it (here FAILED_PRECONDITION: the server runs without --allow-runtime-lora-updating),
and ListLoraAdapters is open to every key. A real port with a simulated worker."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc
from scheduler_service.api.api_options import ApiOptions
from tests.support.sim_server import SimServer
from tests.support.vllm_sim import rpc_code

ADMIN, TENANT = "lora-key-admin-0123456789", "lora-key-tenant-012345678"


@pytest.fixture
def stub(model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{ADMIN} admin\n{TENANT}\n")
    srv = SimServer(model_dir, api=ApiOptions(api_key_file=str(keys)))
    with grpc.insecure_channel(srv.target) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)
    srv.close()


def _as(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def test_runtime_lora_calls_are_the_operators(stub):
    load = pb.LoadLoraAdapterRequest(lora_name="sql", lora_path="/adapters/sql")
    unload = pb.UnloadLoraAdapterRequest(lora_name="sql")
    for call, request in ((stub.LoadLoraAdapter, load), (stub.UnloadLoraAdapter, unload)):
        code, details = rpc_code(lambda: call(request, timeout=10, metadata=_as(TENANT)))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "admin" in details, details
        code, details = rpc_code(lambda: call(request, timeout=10, metadata=_as(ADMIN)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert "--allow-runtime-lora-updating" in details
    listed = stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=10,
                                   metadata=_as(TENANT))
    assert list(listed.adapters) == []
