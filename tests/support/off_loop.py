"""Harness for "heavy work does not stall other streams" tests: a gate that holds the heavy work
on the serving side until a running stream has received more tokens, both public services on a
loopback port over an in-process engine, and a count of another thread's turns during a call
(how a test shows that native code releases the GIL)."""
from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Callable

import grpc

from deltaserve.llm import LLM
from engine_common.wire.protos import generation_pb2 as pb
from engine_common.wire.protos import generation_pb2_grpc, vllm_engine_pb2_grpc
from scheduler_service.api.front_door import ServedModel
from scheduler_service.api.generation_servicer import GenerationServicer
from scheduler_service.api.vllm_convert import EngineShape
from scheduler_service.api.vllm_servicer import VllmEngineServicer
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.kv_event_publisher import KvEventPublisher
from scheduler_service.engine.output_processor import OutputProcessor

STALL_LIMIT_S = 60.0
NUM_TOKENS_WHILE_HELD = 3


class Gate:
    """`hold()` (called from the heavy work) waits for `release`; giving up after
    STALL_LIMIT_S records a stall instead of hanging the test."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.stalled = False

    def hold(self) -> None:
        self.entered.set()
        self.stalled = not self.release.wait(STALL_LIMIT_S)


async def tokens_while_held(llm: LLM, served: ServedModel, gate: Gate,
                            heavy: Callable[[grpc.aio.Channel], Awaitable],
                            message_bytes: int = 4 << 20):
    """Serve both services; start a long stream; send `heavy(channel)`; once it is held at the
    gate, take NUM_TOKENS_WHILE_HELD more tokens, then release it. Returns (heavy's result, the
    order of events). If heavy finishes without reaching the gate, returns at once."""
    engine = AsyncEngine(lambda: llm.engine.core, lambda: OutputProcessor(llm.tokenizer))
    engine.start()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", message_bytes)])
    _add_services(engine, served, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        assert await asyncio.to_thread(engine.wait_ready, 60), engine.last_error
        async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", message_bytes)]
        ) as ch:
            return await _race(ch, gate, heavy)
    finally:
        await server.stop(None)
        engine.shutdown()


async def _race(ch: grpc.aio.Channel, gate: Gate, heavy) -> tuple:
    victim = generation_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
        token_ids=[3, 14, 15], stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True)))
    order = []
    stream = victim.__aiter__()
    await stream.__anext__()
    work = asyncio.ensure_future(heavy(ch))
    # Polled: heavy either reaches the gate (a threading.Event, set on a tokenizer thread) or
    # ends first; a thread blocked on the event would outlive a return before the gate.
    while not gate.entered.is_set():
        if work.done():                       # refused before the gate: nothing to wait on
            return work.result(), order
        await asyncio.sleep(0.01)
    for _ in range(NUM_TOKENS_WHILE_HELD):
        await stream.__anext__()
        order.append("token")
    gate.release.set()
    result = await work
    order.append("heavy done")
    victim.cancel()
    return result, order


def _add_services(engine: AsyncEngine, served: ServedModel, server: grpc.aio.Server) -> None:
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine, served),
                                                         server)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(
        engine, served, EngineShape(4, 4, "float32", "auto"), KvEventPublisher(),
        lambda: engine.ready), server)


def other_thread_turns(call: Callable[[], object]) -> tuple[object, int]:
    """(call's result, how many loop turns another Python thread made meanwhile). Native code
    holding the GIL lets it run only at the interpreter's switch interval (a handful of
    turns); released, it spins freely (tens of thousands)."""
    turns, done = [0], threading.Event()

    def count() -> None:
        while not done.is_set():
            turns[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    try:
        before = turns[0]
        result = call()
        return result, turns[0] - before
    finally:
        done.set()
        thread.join()
