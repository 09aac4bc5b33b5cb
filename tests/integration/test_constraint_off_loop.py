"""A big structured-output constraint does not stall the other streams: both public services
(deltaserve.v1.Generation and VllmEngine) have llguidance validate a request's constraint on the
tokenizer pool, and the event loop keeps delivering a running stream's tokens meanwhile.

No timing: the validation of the big constraint blocks until the running stream has received
three more tokens. If it ran on the event loop, those tokens could never arrive while it blocks
(the test then records a stall). llguidance must release the GIL while it validates: checked by
counting another thread's turns during a real validation.
"""
from __future__ import annotations

import asyncio

import grpc
import llguidance
import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from scheduler_service.api.front_door import ServedModel
from tests.support.off_loop import Gate, other_thread_turns, tokens_while_held

# 3,000 alternatives (49,889 characters, under the default --max-constraint-chars; their counted
# repetitions add 6,000 atoms, under the bound of 10,000), then an
# unclosed group: the engine works through it all before refusing it.
HEAVY = "|".join(f"word{i}[a-z]{{3}}" for i in range(3000))
BAD_HEAVY = HEAVY + "|(unclosed"

pytestmark = pytest.mark.slow


def gated_validate(real, gate: Gate):
    """Constraint.validate, but validating BAD_HEAVY is held at the gate first."""
    def validate(constraint: Constraint) -> Constraint:
        if constraint.value == BAD_HEAVY:
            gate.hold()
        return real(constraint)
    return validate


async def _heavy_constraint(ch: grpc.aio.Channel, service: str) -> grpc.aio.AioRpcError:
    """A Generate carrying BAD_HEAVY to `service`: the status it is refused with."""
    if service == "generation":
        call = generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            token_ids=[3, 14, 15], constraint=pb.Constraint(regex=BAD_HEAVY)))
    else:
        call = vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(vllm_engine_pb2.GenerateRequest(
            request_id="heavy", text="hello",
            sampling_params=vllm_engine_pb2.SamplingParams(regex=BAD_HEAVY)))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            pass
    return e.value


@pytest.mark.parametrize("service", ["generation", "vllm"])
def test_a_big_constraint_does_not_stall_another_stream(tiny_models, monkeypatch, service):
    llm = LLM(tiny_models("qwen3"), dtype="float32", num_kv_blocks=64, max_model_len=512,
              max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    gate = Gate()
    monkeypatch.setattr(Constraint, "validate", gated_validate(Constraint.validate, gate))
    served = ServedModel(info=llm.model_info, tokenizer=llm.tokenizer, block_size=4)
    refused, order = asyncio.run(tokens_while_held(
        llm, served, gate, lambda ch: _heavy_constraint(ch, service)))
    assert not gate.stalled, "the stream got no tokens while the constraint was validated"
    assert order == ["token"] * 3 + ["heavy done"]
    field = "constraint.regex" if service == "generation" else "sampling_params.regex"
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert field in refused.details() and "unclosed" in refused.details(), refused.details()


def test_validation_releases_the_gil():
    grammar = Constraint("regex", HEAVY).to_grammar()
    errors, turns = other_thread_turns(
        lambda: [llguidance.LLMatcher.validate_grammar(grammar) for _ in range(5)])
    assert errors == [""] * 5 and turns > 10_000, turns
