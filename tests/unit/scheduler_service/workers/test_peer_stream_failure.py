"""Several nodes: a step fails as soon as any node's Step stream fails, not after node 0's
step timeout.

A rank that dies on node 1 fails node 1's Step stream at once (UNAVAILABLE, the rank named),
while node 0's ranks wait in a collective for the dead peer (NCCL never notices: until
--dist-timeout). The client waited for node 0's reply first: `--step-timeout`, then node 0
answered Health (its service is fine, only its ranks are stuck), so it was "slow" and got
another step timeout, up to 30 in all (five minutes at the defaults) before the requests failed
with node 1's news. Two in-process fake workers on loopback: node 0 never replies, node 1 fails
its first step."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from scheduler_service.errors import WorkerFailure
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.init_specs import init_spec

# The worker's (worker_service/service/server.py): the client pings every second.
KEEPALIVE = (("grpc.keepalive_permit_without_calls", 1),
             ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
             ("grpc.http2.max_ping_strikes", 0))


class FakeNode(worker_pb2_grpc.WorkerServicer):
    """Node `node_rank` of `num_nodes`; its Step stream never replies (a rank stuck in a
    collective) or fails its first step as a worker whose rank died does."""

    def __init__(self, node_rank: int, num_nodes: int, fail_steps: bool):
        self.node_rank, self.num_nodes, self.fail_steps = node_rank, num_nodes, fail_steps
        self.step_seen = threading.Event()
        self.released = threading.Event()

    def Info(self, request, context):
        return worker_pb2.InfoResponse(layout=worker_pb2.ParallelLayout(
            node_rank=self.node_rank, num_nodes=self.num_nodes, num_local_ranks=1,
            tp_size=self.num_nodes))

    def Health(self, request, context):
        return worker_pb2.HealthResponse(ready=True)

    def Init(self, request, context):
        return worker_pb2.InitResponse(num_kv_blocks=16, epoch=request.epoch)

    def Step(self, request_iterator, context):
        for req in request_iterator:
            self.step_seen.set()
            if self.fail_steps:
                yield worker_pb2.StepResponse(epoch=req.epoch, step=req.step,
                                              error=worker_pb2.StepError(
                                                  code=worker_pb2.StepError.RANK_FAILED,
                                                  message="rank 1 (local rank 0, pid 4242) was "
                                                          "killed by signal 9 (SIGKILL)"))
                context.abort(grpc.StatusCode.UNAVAILABLE, "rank 1 was killed")
            self.released.wait(120)     # stuck until the test ends (or the call is cancelled)
            return


@pytest.fixture
def nodes():
    servers, fakes, addresses = [], [], []
    for node in range(2):
        fake = FakeNode(node, 2, fail_steps=node == 1)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=KEEPALIVE)
        worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        fakes.append(fake)
        addresses.append(f"127.0.0.1:{port}")
    yield fakes, addresses
    for fake in fakes:
        fake.released.set()
    for server in servers:
        server.stop(None)


def test_a_failed_node_fails_the_step_while_node_0_is_stuck(nodes, tiny_models):
    fakes, addresses = nodes
    # Step timeouts far beyond the test's wait: only node 1's failure can end the step.
    client = WorkerClient(addresses, connect_timeout_s=30, step_timeout_s=600)
    outcome: list = []
    try:
        client.init(init_spec(tiny_models("qwen3"), max_model_len=64))

        def run() -> None:
            try:
                outcome.append(client.execute(b"diff"))
            except WorkerFailure as e:
                outcome.append(e)
        stepper = threading.Thread(target=run, daemon=True)
        stepper.start()
        assert fakes[0].step_seen.wait(60) and fakes[1].step_seen.wait(60)
        stepper.join(60)
        assert outcome, "the step still waits for node 0 although node 1 failed it"
        error = outcome[0]
        assert isinstance(error, WorkerFailure), error
        assert addresses[1] in str(error) and "RANK_FAILED" in str(error), error
        assert "killed by signal 9" in str(error), error
        # The client is failed until the next init: the next step is refused at once.
        with pytest.raises(WorkerFailure, match="unusable"):
            client.execute(b"diff")
    finally:
        fakes[0].released.set()
        client.close()
