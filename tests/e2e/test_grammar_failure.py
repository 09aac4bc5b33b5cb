"""Over real processes (a CPU worker with the tiny model, a scheduler, loopback gRPC): a request
whose grammar fails on the worker mid-request (its mask leaves none of its allowed_token_ids, so
every logit would be -inf) travels back in RunnerOutput.request_errors and ends that stream with
INTERNAL naming the request and the failure, on deltaserve.v1.Generation and VllmEngine; a plain
request beside it finishes normally, every KV block comes back, and both processes serve on."""
from __future__ import annotations

import threading

import grpc
import pytest

from engine_common.wire.protos import vllm_engine_pb2, vllm_engine_pb2_grpc
from tests.support.grpc_harness import (collect, generation_stub, greedy_request, pb,
                                        scheduler_and_worker, server_status, wait_for)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(tiny_models, tmp_path_factory):
    with scheduler_and_worker(tiny_models("qwen3"), tmp_path_factory.mktemp("grammar-failure")) as served:
        yield served


def _failure(call) -> tuple[grpc.StatusCode, str]:
    try:
        list(call())
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_a_grammar_failing_on_the_worker_ends_its_stream_with_internal(target):
    address, procs = target
    with grpc.insecure_channel(address) as ch:
        stub = generation_stub(ch)
        (letter,) = stub.Tokenize(pb.TokenizeRequest(text="x"), timeout=30).token_ids
        plain: list = []
        beside = threading.Thread(target=lambda: plain.append(collect(stub.Generate(
            greedy_request([5, 6, 7, 8, 9], 24, "plain"), timeout=120))))
        beside.start()
        picky = pb.GenerateRequest(
            request_id="picky", token_ids=[5, 6, 7], constraint=pb.Constraint(regex="[0-9]+"),
            sampling=pb.SamplingParams(allowed_token_ids=[letter]),
            stopping=pb.StoppingCriteria(max_tokens=8))
        code, details = _failure(lambda: stub.Generate(picky, timeout=120))
        beside.join(120)
        assert code == grpc.StatusCode.INTERNAL, details
        assert details.startswith("request 'picky' failed on the worker: allowed_token_ids and "
                                  "its grammar leave no token to sample"), details
        (ids, _, msgs), = plain
        assert len(ids) == 24 and msgs[-1].finish_reason == pb.LENGTH

        engine = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        code, details = _failure(lambda: engine.Generate(vllm_engine_pb2.GenerateRequest(
            request_id="picky-vllm", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6]),
            sampling_params=vllm_engine_pb2.SamplingParams(
                max_tokens=8, temperature=0, regex="[0-9]+", allowed_token_ids=[letter])),
            timeout=120))
        assert code == grpc.StatusCode.INTERNAL, details
        assert "'picky-vllm' failed on the worker: allowed_token_ids and its grammar" in details
        ids, _, _ = collect(stub.Generate(greedy_request([5, 6, 7], 4), timeout=120))
        assert len(ids) == 4
    wait_for(lambda: server_status(address).num_used_kv_blocks == 0, 30, "every block back",
             procs)
    assert all(p.alive() for p in procs)
