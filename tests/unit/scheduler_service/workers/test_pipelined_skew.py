"""Three steps in flight only when every node pipelines its steps (InitResponse.pipelined, field
10): a node of an older build (no field 10), or one that does not pipeline, keeps the engine at
two; so do sync scheduling and speculative decoding. Two in-process fake nodes on loopback
answer Init through the real WorkerClient; the factory's EngineCore is checked, and its log line
says the depth the core really keeps."""
from __future__ import annotations

import logging
from concurrent import futures

import grpc
import pytest

from engine_common.configuration.config import SchedulerConfig
from engine_common.wire.protos import worker_pb2_grpc
from scheduler_service.api import worker_core_factory
from scheduler_service.api.worker_core_factory import WorkerCoreFactory
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.init_specs import init_spec
from tests.unit.scheduler_service.workers.test_stream_keys_per_node import KeyedNode

NGRAM = ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, '
         '"prompt_lookup_min": 1}')


class Node(KeyedNode):
    """Node `node_rank` of two; `pipelined` None answers as a build before field 10 does."""

    def __init__(self, node_rank: int, pipelined: bool | None):
        super().__init__(node_rank)
        self.pipelined = pipelined

    def Init(self, request, context):
        reply = super().Init(request, context)
        if self.pipelined is not None:
            reply.pipelined = self.pipelined
        return reply


@pytest.fixture
def serve():
    servers = []

    def start(*pipelined) -> list[str]:
        addresses = []
        for rank, p in enumerate(pipelined):
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            worker_pb2_grpc.add_WorkerServicer_to_server(Node(rank, p), server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            server.start()
            servers.append(server)
        return addresses
    yield start
    for server in servers:
        server.stop(None)


@pytest.mark.parametrize("pipelined,config,depth", [
    ((True, True), {}, 3),
    ((True, None), {}, 2),                   # node 1 of an older build
    ((None, True), {}, 2),
    ((True, False), {}, 2),                  # node 1 does not pipeline (TP ranks, CPU)
    ((True, True), {"async_scheduling": False}, 2),
    ((True, True), {"speculative_config": NGRAM}, 2),
], ids=["both", "old-node1", "old-node0", "mixed", "sync", "spec"])
def test_three_in_flight_only_when_every_node_pipelines(serve, tiny_models, caplog, pipelined,
                                                        config, depth):
    client = WorkerClient(serve(*pipelined), connect_timeout_s=30, step_timeout_s=60)
    cfg = SchedulerConfig(**{"block_size": 4, "max_model_len": 64, "async_scheduling": True,
                             **config})
    try:
        with caplog.at_level(logging.INFO, logger=worker_core_factory.__name__):
            core = WorkerCoreFactory(client, init_spec(tiny_models("qwen3"), max_model_len=64),
                                     cfg)()
    finally:
        client.close()
    assert core.steps_in_flight == depth
    said = [r.getMessage() for r in caplog.records if "workers initialized" in r.getMessage()]
    assert len(said) == 1
    assert ("pipeline their steps" in said[0]) == all(pipelined)
    assert ("(3 in flight)" in said[0]) == (depth == 3)
    if all(pipelined) and cfg.async_scheduling:
        assert f"({depth} in flight)" in said[0]
