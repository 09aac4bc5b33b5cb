"""An Init whose values are huge is refused with a clear INVALID_ARGUMENT, never a status the
client cannot read.

A model_dir of 100,000 characters failed deep in the file checks (OSError: File name too long,
logged as an INTERNAL failure with its traceback) and its status repeated the whole path: past
gRPC's 16 KiB metadata limit, so the scheduler saw RESOURCE_EXHAUSTED "received metadata size
exceeds hard limit" instead of the reason. A real worker service on loopback."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from tests.support.grpc_harness import bearer
from tests.support.inproc_worker import cpu_worker

TOKEN = "test-token-0123456789abcdef"
LIMITS = dict(dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, kv_cache_bytes=1 << 20)


@pytest.fixture(scope="module")
def stub():
    with cpu_worker(TOKEN) as address, grpc.insecure_channel(address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def _init(stub, epoch: int, **config):
    request = worker_pb2.InitRequest(epoch=epoch, scheduler_id="s",
                                     config=worker_pb2.WorkerConfig(**{**LIMITS, **config}))
    return stub.Init(request, timeout=60, metadata=bearer(TOKEN))


@pytest.mark.parametrize("model_dir", ["x" * 100_000, "/tmp/" + "d/" * 3000, "/" + "y" * 300])
def test_a_huge_model_dir_is_refused_naming_it_clipped(stub, model_dir):
    with pytest.raises(grpc.RpcError) as refused:
        _init(stub, 1, model_dir=model_dir)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    details = refused.value.details()
    assert "model_dir" in details and f"({len(repr(model_dir))} characters)" in details, details
    assert len(details) < 2_000


def test_the_worker_still_serves_an_init_after_them(stub, tiny_models):
    reply = _init(stub, 2, model_dir=tiny_models("qwen3"))
    assert reply.num_kv_blocks > 0
