"""A request whose grammar fails on the worker mid-request (here: a mask that leaves none of its
allowed_token_ids, as the workers report it in RunnerOutput.request_errors) ends with a gRPC
status, not a normal finish: INTERNAL naming the request and the grammar failure, as any request
that fails on our side (status.py: RequestFailed), on deltaserve.v1.Generation and on VllmEngine
(vLLM's own servicer ends a failed request with INTERNAL too). The other requests finish as
usual and every KV block comes back. Fixtures (SimServer): conftest.py."""
from __future__ import annotations

import threading

import grpc

from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.vllm_sim import PROMPT, generate, rpc_code, wait_until


def _letter_id(server) -> int:
    (token,) = server.tokenizer.backend.encode("x", add_special_tokens=False).ids
    return token


def _others_finish(server, results: list) -> threading.Thread:
    """Four plain requests streamed beside the failing one, on their own thread."""
    def run():
        with grpc.insecure_channel(server.target) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            for i in range(4):
                msgs = list(stub.Generate(gpb.GenerateRequest(
                    request_id=f"plain-{i}", token_ids=PROMPT,
                    stopping=gpb.StoppingCriteria(max_tokens=8, ignore_eos=True)), timeout=30))
                results.append((sum(len(m.token_ids) for m in msgs), msgs[-1].finish_reason))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_generation_ends_a_failed_grammar_with_internal_naming_it(server):
    results: list = []
    others = _others_finish(server, results)
    request = gpb.GenerateRequest(
        request_id="picky", token_ids=PROMPT,
        sampling=gpb.SamplingParams(allowed_token_ids=[_letter_id(server)]),
        stopping=gpb.StoppingCriteria(max_tokens=8), constraint=gpb.Constraint(regex="[0-9]+"))
    with grpc.insecure_channel(server.target) as ch:
        code, details = rpc_code(lambda: generation_pb2_grpc.GenerationStub(ch).Generate(
            request, timeout=30))
    others.join(60)
    assert code == grpc.StatusCode.INTERNAL, details
    assert details.startswith("request 'picky' failed on the worker: allowed_token_ids and "
                              "its grammar leave no token"), details
    assert details.endswith("other requests are unaffected")
    assert results == [(8, gpb.LENGTH)] * 4
    wait_until(lambda: server.used_blocks() == 0, "every block back")


def test_vllm_engine_ends_a_failed_grammar_with_internal_naming_it(server):
    with grpc.insecure_channel(server.target) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        for stream in (True, False):
            code, details = rpc_code(lambda: stub.Generate(generate(
                request_id=f"picky-{stream}", stream=stream, max_tokens=8, regex="[0-9]+",
                allowed_token_ids=[_letter_id(server)]), timeout=30))
            assert code == grpc.StatusCode.INTERNAL, details
            assert "failed on the worker: allowed_token_ids and its grammar" in details
            (done,) = list(stub.Generate(generate(request_id="after", max_tokens=3), timeout=30))
            assert done.complete.finish_reason == "length"
    wait_until(lambda: server.used_blocks() == 0, "every block back")
