"""The scheduler opens each node's Step stream with the stream key that node's Init (or Reset)
returned: every node of a tensor-parallel group starts the epoch with its own key, and a
stream with another node's key is refused there. Two in-process fake workers on loopback that
hand out their own keys and record the key each Step stream presents."""
from __future__ import annotations

import secrets
from concurrent import futures

import grpc
import pytest

from engine_common.security.stream_key import STREAM_KEY_METADATA
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.init_specs import init_spec


class KeyedNode(worker_pb2_grpc.WorkerServicer):
    """Node `node_rank` of two: a new key per Init and Reset; Step answers only with it."""

    def __init__(self, node_rank: int):
        self.node_rank = node_rank
        self.key = b""
        self.presented: list[bytes | None] = []

    def Info(self, request, context):
        return worker_pb2.InfoResponse(layout=worker_pb2.ParallelLayout(
            node_rank=self.node_rank, num_nodes=2, num_local_ranks=1, tp_size=2))

    def Health(self, request, context):
        return worker_pb2.HealthResponse(ready=True)

    def Init(self, request, context):
        self.key = secrets.token_bytes(32)
        return worker_pb2.InitResponse(num_kv_blocks=16, epoch=request.epoch,
                                       stream_key=self.key)

    def Reset(self, request, context):
        self.key = secrets.token_bytes(32)
        return worker_pb2.ResetResponse(epoch=request.epoch, stream_key=self.key)

    def Step(self, request_iterator, context):
        presented = dict(context.invocation_metadata()).get(STREAM_KEY_METADATA)
        self.presented.append(presented)
        if presented != self.key:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong stream key")
        for req in request_iterator:
            yield worker_pb2.StepResponse(epoch=req.epoch, step=req.step, payload=b"out")


@pytest.fixture
def nodes():
    servers, fakes, addresses = [], [], []
    for node in range(2):
        fake = KeyedNode(node)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
        fakes.append(fake)
    yield fakes, addresses
    for server in servers:
        server.stop(None)


def test_each_nodes_stream_presents_that_nodes_key(nodes, tiny_models):
    fakes, addresses = nodes
    client = WorkerClient(addresses, connect_timeout_s=30, step_timeout_s=60)
    try:
        client.init(init_spec(tiny_models("qwen3"), max_model_len=64))
        assert client.execute(b"diff") == b"out"
        first = [fake.key for fake in fakes]
        assert first[0] != first[1]
        assert [fake.presented for fake in fakes] == [[first[0]], [first[1]]]
        client.reset()                       # new keys; new streams present them
        assert client.execute(b"diff") == b"out"
        assert [fake.presented[-1] for fake in fakes] == [fake.key for fake in fakes]
        assert all(fake.key not in first for fake in fakes)
    finally:
        client.close()
