"""Prompt logprobs over gRPC, both public services on a loopback port over an in-process engine
(a real tiny model, chunked prefill: 8 tokens a step): Generate's `prompt_logprobs` (entries on
the first message only, the first naming prompt[0] without a logprob) and the vLLM engine
protocol's `sampling_params.prompt_logprobs` (input_logprobs as vLLM's servicer sends them:
streamed on the first chunk of each choice, otherwise on each choice's complete, n = 2), equal
to transformers'; out-of-range values are INVALID_ARGUMENT naming the field and range."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from deltaserve.llm import LLM
from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from scheduler_service.api.front_door import ServedModel
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.engine.request_output import PromptLogprob
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.off_loop import _add_services
from tests.support.prompt_logprobs_reference import assert_matches_hf

PROMPT = list(range(5, 25))
vpb = vllm_engine_pb2


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=4,
               max_num_batched_tokens=8, enable_prefix_caching=True)


def _serve(llm: LLM, talk) -> object:
    """Run `talk(channel)` against both services over `llm`'s engine core."""
    async def main():
        engine = AsyncEngine(lambda: llm.engine.core, lambda: OutputProcessor(llm.tokenizer))
        engine.start()
        server = grpc.aio.server()
        _add_services(engine, ServedModel(info=llm.model_info, tokenizer=llm.tokenizer,
                                          block_size=4), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            assert await asyncio.to_thread(engine.wait_ready, 60), engine.last_error
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await talk(ch)
        finally:
            await server.stop(None)
            engine.shutdown()
    return asyncio.run(main())


def _from_generate(entries) -> list:
    return [None] + [PromptLogprob(e.token_id, e.logprob, e.rank,
                                   [t.token_id for t in e.top_logprobs],
                                   [t.logprob for t in e.top_logprobs]) for e in entries[1:]]


def _from_vllm(msg, k: int) -> list:
    out = [None]
    for i in range(1, len(msg.token_ids)):
        top = msg.top_logprobs[i] if k else None
        out.append(PromptLogprob(msg.token_ids[i], msg.token_logprobs[i].value, 0,
                                 list(top.token_ids) if top else [],
                                 list(top.values) if top else []))
    return out


def test_generate_returns_them_on_the_first_message(llm, model):
    async def talk(ch):
        stub = generation_pb2_grpc.GenerationStub(ch)
        return [m async for m in stub.Generate(pb.GenerateRequest(
            token_ids=PROMPT, prompt_logprobs=3,
            stopping=pb.StoppingCriteria(max_tokens=4, ignore_eos=True)))]
    msgs = _serve(llm, talk)
    first = msgs[0].prompt_logprobs
    assert len(first) == len(PROMPT) and all(not m.prompt_logprobs for m in msgs[1:])
    assert first[0].token_id == PROMPT[0] and not first[0].HasField("logprob")
    assert first[0].rank == 0 and not first[0].top_logprobs
    assert all(e.HasField("logprob") for e in first[1:])
    assert_matches_hf(_from_generate(first), model, PROMPT, 3)
    assert sum(len(m.token_ids) for m in msgs) == 4
    assert msgs[-1].usage.cached_prompt_tokens == 0
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_protocol_returns_input_logprobs_for_each_choice(llm, model, stream):
    async def talk(ch):
        stub = vllm_engine_pb2_grpc.VllmEngineStub(ch)
        return [m async for m in stub.Generate(vpb.GenerateRequest(
            request_id=f"pl-{stream}", tokenized=vpb.TokenizedInput(input_ids=PROMPT),
            stream=stream, sampling_params=vpb.SamplingParams(
                prompt_logprobs=2, max_tokens=3, ignore_eos=True, n=2, temperature=0.8,
                seed=7)))]
    msgs = _serve(llm, talk)
    for index in (0, 1):
        mine = [m for m in msgs if getattr(m, m.WhichOneof("response")).index == index]
        with_input = [m for m in mine if getattr(m, m.WhichOneof("response"))
                      .HasField("input_logprobs")]
        kind = "chunk" if stream else "complete"
        if stream:
            # As vLLM's servicer: on the first chunk, and also on the complete when one engine
            # output was both the first and the last (a slow consumer's steps merged into one).
            chunks = [m for m in with_input if m.WhichOneof("response") == "chunk"]
            assert len(chunks) == 1, (index, len(chunks))
            first = next(m for m in mine if m.WhichOneof("response") == "chunk")
            assert chunks[0] is first
            completes = [m for m in with_input if m.WhichOneof("response") == "complete"]
            assert len(completes) <= 1
            if completes:
                assert len(first.chunk.token_ids) == 3          # the whole choice in one output
                assert completes[0].complete.input_logprobs == first.chunk.input_logprobs
            with_input = chunks
        assert len(with_input) == 1, (index, len(with_input))
        assert with_input[0].WhichOneof("response") == kind
        got = getattr(with_input[0], kind).input_logprobs
        assert list(got.token_ids) == PROMPT
        assert not got.token_logprobs[0].HasField("value")
        assert len(got.top_logprobs) == len(PROMPT) and not got.top_logprobs[0].token_ids
        assert_matches_hf(_from_vllm(got, 2), model, PROMPT, 2, ranks=False)  # none sent
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("service,value", [("generation", 21), ("vllm", -1), ("vllm", 21)])
def test_out_of_range_is_invalid_argument_naming_the_field(llm, service, value):
    async def talk(ch):
        if service == "generation":
            call = generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                token_ids=PROMPT, prompt_logprobs=value))
        else:
            call = vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(vpb.GenerateRequest(
                request_id="bad", tokenized=vpb.TokenizedInput(input_ids=PROMPT),
                sampling_params=vpb.SamplingParams(prompt_logprobs=value)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call:
                pass
        return err.value
    err = _serve(llm, talk)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    field = "prompt_logprobs" if service == "generation" else "sampling_params.prompt_logprobs"
    assert field in err.details() and str(value) in err.details() and "[0, 20]" in err.details()


@pytest.mark.parametrize("stream", [False, True])
def test_their_messages_are_built_off_the_event_loop(llm, monkeypatch, stream):
    """Building the messages of a 100k-token prompt's prompt logprobs takes seconds of CPU
    (20 alternatives: ~2.7 s for Generate's, ~0.5 s for vLLM's on a loaded Xeon): on the event
    loop that would stall every other stream. Both services build them in a worker thread."""
    import threading

    from scheduler_service.api import generation_servicer, vllm_servicer
    threads = []

    def recording(build, has_them):
        def wrapper(*args):
            if has_them(args):
                threads.append(threading.current_thread())
            return build(*args)
        return wrapper
    monkeypatch.setattr(generation_servicer, "output_to_proto", recording(
        generation_servicer.output_to_proto, lambda a: a[0].prompt_logprobs is not None))
    monkeypatch.setattr(vllm_servicer, "messages", recording(
        vllm_servicer.messages, lambda a: a[2].prompt_logprobs is not None
        or (a[2].finished and a[3].prompt_logprobs is not None)))

    async def talk(ch):
        generate = generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            token_ids=PROMPT, prompt_logprobs=2,
            stopping=pb.StoppingCriteria(max_tokens=2, ignore_eos=True)))
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(vpb.GenerateRequest(
            request_id=f"off-{stream}", tokenized=vpb.TokenizedInput(input_ids=PROMPT),
            stream=stream, sampling_params=vpb.SamplingParams(
                prompt_logprobs=2, max_tokens=2, ignore_eos=True)))
        return [m async for m in generate], [m async for m in vllm]
    generated, from_vllm = _serve(llm, talk)
    assert len(generated[0].prompt_logprobs) == len(PROMPT) and from_vllm
    assert len(threads) >= 2 and threading.main_thread() not in threads, threads
