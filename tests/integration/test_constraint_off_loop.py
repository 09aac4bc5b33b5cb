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
import threading

import grpc
import llguidance
import pytest

from deltaserve.llm import LLM
from engine_common.constraint import Constraint
from engine_common.protos import generation_pb2 as pb
from engine_common.protos import generation_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from scheduler_service.api.generation_servicer import GenerationServicer, ServedModel
from scheduler_service.api.vllm_convert import EngineShape
from scheduler_service.api.vllm_servicer import VllmEngineServicer
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.kv_event_publisher import KvEventPublisher
from scheduler_service.engine.output_processor import OutputProcessor

# 3,000 alternatives (55,889 characters, under the default --max-constraint-chars), then an
# unclosed group: the engine works through it all before refusing it.
HEAVY = "|".join(f"word{i}[a-z]{{3,9}}" for i in range(3000))
BAD_HEAVY = HEAVY + "|(unclosed"
STALL_LIMIT_S = 60.0

pytestmark = pytest.mark.slow


class ValidationGate:
    """Constraint.validate, but validating BAD_HEAVY waits for `release` (or gives up,
    recording a stall) before the real validation runs."""

    def __init__(self, real):
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.stalled = False

    def __call__(self, constraint: Constraint) -> Constraint:
        if constraint.value == BAD_HEAVY:
            self.entered.set()
            self.stalled = not self.release.wait(STALL_LIMIT_S)
        return self.real(constraint)


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


def _servicers(engine: AsyncEngine, served: ServedModel, server: grpc.aio.Server) -> None:
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, served),
                                                         server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(
        engine, served, EngineShape(4, 4, "float32", "auto"), KvEventPublisher(),
        lambda: engine.ready), server)


async def _scenario(llm: LLM, gate: ValidationGate, service: str):
    engine = AsyncEngine(lambda: llm.engine.core, lambda: OutputProcessor(llm.tokenizer))
    engine.start()
    server = grpc.aio.server()
    _servicers(engine, ServedModel(info=llm.model_info, tokenizer=llm.tokenizer, block_size=4),
               server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        while not engine.ready:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            victim = generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                token_ids=[3, 14, 15], stopping=pb.StoppingCriteria(max_tokens=200,
                                                                    ignore_eos=True)))
            order = []
            stream = victim.__aiter__()
            await stream.__anext__()
            heavy = asyncio.ensure_future(_heavy_constraint(ch, service))
            while not gate.entered.is_set():
                if heavy.done():                  # refused before validating: no gate to wait on
                    return heavy.result(), order
                await asyncio.sleep(0.01)
            for _ in range(3):                    # tokens while the constraint is validated
                await stream.__anext__()
                order.append("token")
            gate.release.set()
            refused = await heavy
            order.append("validated")
            victim.cancel()
            return refused, order
    finally:
        await server.stop(None)
        engine.shutdown()


@pytest.mark.parametrize("service", ["generation", "vllm"])
def test_a_big_constraint_does_not_stall_another_stream(tiny_models, monkeypatch, service):
    llm = LLM(tiny_models("qwen3"), dtype="float32", num_kv_blocks=64, max_model_len=512,
              max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    gate = ValidationGate(Constraint.validate)
    monkeypatch.setattr(Constraint, "validate", lambda constraint: gate(constraint))
    refused, order = asyncio.run(_scenario(llm, gate, service))
    assert not gate.stalled, "the stream got no tokens while the constraint was validated"
    assert order == ["token"] * 3 + ["validated"]
    field = "constraint.regex" if service == "generation" else "sampling_params.regex"
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert field in refused.details() and "unclosed" in refused.details(), refused.details()


def test_validation_releases_the_gil():
    grammar = Constraint("regex", HEAVY).to_grammar()
    turns, done = [0], threading.Event()

    def count() -> None:
        while not done.is_set():
            turns[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    try:
        before = turns[0]
        errors = [llguidance.LLMatcher.validate_grammar(grammar) for _ in range(5)]
        during = turns[0] - before
    finally:
        done.set()
        thread.join()
    # Holding the GIL, llguidance would let the counter run only at the interpreter's switch
    # interval at best (a handful of turns); released, it spins freely.
    assert errors == [""] * 5 and during > 10_000, during
