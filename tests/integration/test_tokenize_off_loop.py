"""One big text does not stall the other streams: the Generation service's Tokenize and the
VllmEngine service's Generate (the smg gateway's) tokenize on a thread pool, and the event loop
keeps delivering a running stream's tokens meanwhile.

No timing: the tokenizer of the big text blocks until the running stream has received three more
tokens. If tokenizing ran on the event loop, those tokens could never arrive while it blocks (the
test then records a stall). The tokenizer itself must release the GIL (engine_common/tokenizer.py
uses encode_batch, which does): checked by counting another thread's turns during a real encode.
"""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from deltaserve.llm import LLM
from engine_common.protos import generation_pb2 as pb
from engine_common.protos import generation_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from engine_common.tokenizer import Tokenizer
from scheduler_service.api.generation_servicer import GenerationServicer, ServedModel
from scheduler_service.api.vllm_convert import EngineShape
from scheduler_service.api.vllm_servicer import VllmEngineServicer
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.kv_event_publisher import KvEventPublisher
from scheduler_service.engine.output_processor import OutputProcessor

BIG = "hello world, " * 320_000          # 4.2 million characters: the attack of issue 13
STALL_LIMIT_S = 60.0

pytestmark = pytest.mark.slow


class GatedTokenizer:
    """The real tokenizer; encoding BIG waits for `release` (or gives up, recording a stall)."""

    def __init__(self, real: Tokenizer):
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.stalled = False

    def encode(self, text: str) -> list[int]:
        if text is BIG or len(text) == len(BIG):
            self.entered.set()
            self.stalled = not self.release.wait(STALL_LIMIT_S)
        return self.real.encode(text)

    def __getattr__(self, name):
        return getattr(self.real, name)


async def _big_text(ch: grpc.aio.Channel, service: str) -> int:
    """Send BIG to `service`: Generation's Tokenize answers its token count; VllmEngine's
    Generate tokenizes it, then refuses it as longer than max_model_len (-1)."""
    if service == "generation":
        reply = await generation_pb2_grpc.GenerationStub(ch).Tokenize(pb.TokenizeRequest(text=BIG))
        return reply.num_tokens
    call = vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(vllm_engine_pb2.GenerateRequest(
        request_id="big", text=BIG))
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.details()
    return -1


def _servicers(engine: AsyncEngine, served: ServedModel, server: grpc.aio.Server) -> None:
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, served),
                                                         server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(
        engine, served, EngineShape(4, 4, "float32", "auto"), KvEventPublisher(),
        lambda: engine.ready), server)


async def _scenario(llm: LLM, tokenizer: GatedTokenizer, service: str) -> tuple[int, list]:
    engine = AsyncEngine(lambda: llm.engine.core, lambda: OutputProcessor(tokenizer.real))
    engine.start()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
    served = ServedModel(info=llm.model_info, tokenizer=tokenizer, block_size=4)
    _servicers(engine, served, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        while not engine.ready:
            await asyncio.sleep(0.01)
        async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 16 << 20)]) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            victim = stub.Generate(pb.GenerateRequest(
                token_ids=[3, 14, 15], stopping=pb.StoppingCriteria(max_tokens=200,
                                                                    ignore_eos=True)))
            order = []
            stream = victim.__aiter__()
            await stream.__anext__()
            tokenize = asyncio.ensure_future(_big_text(ch, service))
            while not tokenizer.entered.is_set():
                await asyncio.sleep(0.01)
            for _ in range(3):                    # tokens while the big text is tokenized
                await stream.__anext__()
                order.append("token")
            tokenizer.release.set()
            num_tokens = await tokenize
            order.append("tokenized")
            victim.cancel()
            return num_tokens, order
    finally:
        await server.stop(None)
        engine.shutdown()


@pytest.mark.parametrize("service", ["generation", "vllm"])
def test_a_big_text_does_not_stall_another_stream(tiny_models, service):
    llm = LLM(tiny_models("qwen3"), dtype="float32", num_kv_blocks=64, max_model_len=512,
              max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    tokenizer = GatedTokenizer(llm.tokenizer)
    num_tokens, order = asyncio.run(_scenario(llm, tokenizer, service))
    assert not tokenizer.stalled, "the stream got no tokens while the big text was tokenized"
    assert order == ["token"] * 3 + ["tokenized"]
    assert num_tokens >= BIG.count("hello") if service == "generation" else num_tokens == -1


def test_encoding_releases_the_gil(tiny_models):
    tokenizer = Tokenizer.from_dir(tiny_models("qwen3"))
    turns, done = [0], threading.Event()

    def count() -> None:
        while not done.is_set():
            turns[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    try:
        before = turns[0]
        ids = tokenizer.encode(BIG[:1_000_000])
        during = turns[0] - before
    finally:
        done.set()
        thread.join()
    # A tokenizer holding the GIL lets the counter run only at the interpreter's switch
    # interval at best (a handful of turns); released, it spins freely.
    assert len(ids) > 50_000 and during > 10_000, during
