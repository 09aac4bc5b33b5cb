"""The servicer tests' fixtures: a simulated model directory per module, and per test a
SimServer (the real engine and both gRPC services over a simulated worker) with a VllmEngine
stub on its port."""
from __future__ import annotations

import grpc
import pytest

from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.sim_server import SimServer, make_sim_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_sim_model_dir(tmp_path_factory.mktemp("sim-model"))


@pytest.fixture
def server(model_dir):
    srv = SimServer(model_dir)
    yield srv
    srv.close()


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield vllm_engine_pb2_grpc.VllmEngineStub(channel)
