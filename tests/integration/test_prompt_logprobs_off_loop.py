"""A long prompt's prompt logprobs do not stall the other streams: their entries (~0.8 s of CPU
for a 100k-token prompt at k=20) are built on a servicer's worker thread, never on the event
loop, on both public services.

No timing: building the heavy request's entries blocks until a running stream has received three
more tokens (tests/support/off_loop.py). Built on the event loop, those tokens could never arrive
meanwhile (the gate then records a stall)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from deltaserve.llm import LLM
from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from scheduler_service.api.front_door import ServedModel
from scheduler_service.engine import output_processor, request_output
from tests.support.off_loop import Gate, tokens_while_held

PROMPT = list(range(5, 45))

pytestmark = pytest.mark.slow


async def _with_prompt_logprobs(ch: grpc.aio.Channel, service: str) -> int:
    """The number of prompt logprob entries the client got."""
    if service == "generation":
        msgs = [m async for m in generation_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(token_ids=PROMPT, prompt_logprobs=20,
                               stopping=pb.StoppingCriteria(max_tokens=2, ignore_eos=True)))]
        return sum(len(m.prompt_logprobs) for m in msgs)
    vpb = vllm_engine_pb2
    msgs = [m async for m in vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(
        vpb.GenerateRequest(request_id="heavy", tokenized=vpb.TokenizedInput(input_ids=PROMPT),
                            sampling_params=vpb.SamplingParams(prompt_logprobs=20, max_tokens=2,
                                                               ignore_eos=True)))]
    return sum(len(m.complete.input_logprobs.token_ids) for m in msgs)


@pytest.mark.parametrize("service", ["generation", "vllm"])
def test_prompt_logprob_entries_do_not_stall_another_stream(tiny_models, monkeypatch, service):
    llm = LLM(tiny_models("llama"), dtype="float32", num_kv_blocks=64, max_model_len=512,
              max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    gate = Gate()
    build = request_output.prompt_logprob_entries

    def gated(*args):
        gate.hold()
        return build(*args)
    # Wherever the entries are built from (the output processor imported the function itself
    # when it built them on the loop).
    monkeypatch.setattr(request_output, "prompt_logprob_entries", gated)
    monkeypatch.setattr(output_processor, "prompt_logprob_entries", gated, raising=False)
    served = ServedModel(info=llm.model_info, tokenizer=llm.tokenizer, block_size=4)
    num_entries, order = asyncio.run(tokens_while_held(
        llm, served, gate, lambda ch: _with_prompt_logprobs(ch, service)))
    assert gate.entered.is_set(), "the entries were never built"
    assert not gate.stalled, "the stream got no tokens while the prompt logprobs were built"
    assert order == ["token"] * 3 + ["heavy done"]
    assert num_entries == len(PROMPT)
