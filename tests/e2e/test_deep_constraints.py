"""Constraints nested deeply enough to overflow llguidance's stack (SIGSEGV, the whole process, in
1.9.1) over real processes: the public API refuses them with INVALID_ARGUMENT naming the field,
the depth and the bound, on deltaserve.v1.Generation and VllmEngine alike, and the scheduler and
worker go on serving; a grammar just under the bound compiles on the worker and constrains."""
from __future__ import annotations

import grpc
import pytest

from engine_common.request.diff_limits import MAX_CONSTRAINT_DEPTH
from engine_common.wire.protos import vllm_engine_pb2, vllm_engine_pb2_grpc
from tests.support.deep_constraints import json_items_chain, lark_chain
from tests.support.grpc_harness import (collect, generation_stub, greedy_request, pb,
                                        scheduler_and_worker)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(tiny_models, tmp_path_factory):
    with scheduler_and_worker(tiny_models("qwen3"), tmp_path_factory.mktemp("deep")) as served:
        yield served


def _refusal(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _generate(ch, constraint: pb.Constraint, max_tokens: int = 4):
    req = greedy_request([5, 6, 7], max_tokens)
    req.stopping.ignore_eos = False
    req.constraint.CopyFrom(constraint)
    return collect(generation_stub(ch).Generate(req, timeout=120))


@pytest.mark.parametrize("kind, text, depth", [
    ("grammar", lark_chain(3000), 3002),          # 51,803 characters
    ("json_schema", json_items_chain(1200), 2403),  # 47,038 characters
])
def test_a_constraint_too_deep_is_refused_and_the_server_serves_on(target, kind, text, depth):
    address, procs = target
    with grpc.insecure_channel(address) as ch:
        code, details = _refusal(lambda: _generate(ch, pb.Constraint(**{kind: text})))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert f"constraint.{kind}='nested {depth} deep'" in details
        assert f"at most {MAX_CONSTRAINT_DEPTH} deep" in details
        ids, _, _ = collect(generation_stub(ch).Generate(greedy_request([5, 6, 7], 4),
                                                          timeout=120))
        assert len(ids) == 4
    assert all(p.alive() for p in procs)


def test_vllm_engine_refuses_a_grammar_too_deep(target):
    address, procs = target
    request = vllm_engine_pb2.GenerateRequest(
        request_id="deep", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=3, temperature=0,
                                                       grammar=lark_chain(3000)))
    with grpc.insecure_channel(address) as ch:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        code, details = _refusal(lambda: list(stub.Generate(request, timeout=120)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "sampling_params.grammar" in details and "nested 3002 deep" in details
        assert f"at most {MAX_CONSTRAINT_DEPTH} deep" in details
    assert all(p.alive() for p in procs)


def test_a_grammar_just_under_the_bound_compiles_on_the_worker_and_constrains(target):
    address, procs = target
    with grpc.insecure_channel(address) as ch:
        _, text, _ = _generate(ch, pb.Constraint(grammar=lark_chain(MAX_CONSTRAINT_DEPTH - 2)))
    assert text and set(text) == {"x"}, text
    assert all(p.alive() for p in procs)
