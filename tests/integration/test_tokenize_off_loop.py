"""One big text does not stall the other streams: the Generation service's Tokenize and the
VllmEngine service's Generate (the smg gateway's) tokenize on a thread pool, and the event loop
keeps delivering a running stream's tokens meanwhile.

No timing: the tokenizer of the big text blocks until the running stream has received three more
tokens. If tokenizing ran on the event loop, those tokens could never arrive while it blocks (the
test then records a stall). The tokenizer itself must release the GIL (engine_common/text/tokenizer.py
uses encode_batch, which does): checked by counting another thread's turns during a real encode.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from deltaserve.llm import LLM
from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc, vllm_engine_pb2, vllm_engine_pb2_grpc
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.api.front_door import ServedModel
from tests.support.off_loop import Gate, other_thread_turns, tokens_while_held

BIG = "hello world, " * 320_000          # 4.2 million characters: the attack of issue 13
# A text that may fit max_model_len 512 (issue 23 refuses BIG before tokenizing: 512 tokens x the
# tiny vocabulary's longest token): held at the gate, as slow as the test wants.
LONG = "hello world, " * 300

pytestmark = pytest.mark.slow


class GatedTokenizer:
    """The real tokenizer; encoding LONG is held at the gate first."""

    def __init__(self, real: Tokenizer, gate: Gate):
        self.real = real
        self.gate = gate

    def encode(self, text: str) -> list[int]:
        if text is LONG or len(text) == len(LONG):
            self.gate.hold()
        return self.real.encode(text)

    def __getattr__(self, name):
        return getattr(self.real, name)


async def _big_text(ch: grpc.aio.Channel, service: str) -> int:
    """Send LONG to `service`: Generation's Tokenize answers its token count; VllmEngine's
    Generate tokenizes it, then refuses it as longer than max_model_len (-1)."""
    if service == "generation":
        reply = await generation_pb2_grpc.GenerationStub(ch).Tokenize(
            pb.TokenizeRequest(text=LONG))
        return reply.num_tokens
    call = vllm_engine_pb2_grpc.VllmEngineStub(ch).Generate(vllm_engine_pb2.GenerateRequest(
        request_id="big", text=LONG))
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in e.details()
    return -1


@pytest.mark.parametrize("service", ["generation", "vllm"])
def test_a_big_text_does_not_stall_another_stream(tiny_models, service):
    llm = LLM(tiny_models("qwen3"), dtype="float32", num_kv_blocks=64, max_model_len=512,
              max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    gate = Gate()
    served = ServedModel(info=llm.model_info, tokenizer=GatedTokenizer(llm.tokenizer, gate),
                         block_size=4)
    num_tokens, order = asyncio.run(tokens_while_held(
        llm, served, gate, lambda ch: _big_text(ch, service), message_bytes=16 << 20))
    assert not gate.stalled, "the stream got no tokens while the big text was tokenized"
    assert order == ["token"] * 3 + ["heavy done"]
    assert num_tokens >= LONG.count("hello") if service == "generation" else num_tokens == -1


def test_encoding_releases_the_gil(tiny_models):
    tokenizer = Tokenizer.from_dir(tiny_models("qwen3"))
    ids, turns = other_thread_turns(lambda: tokenizer.encode(BIG[:1_000_000]))
    assert len(ids) > 50_000 and turns > 10_000, turns
