"""The Gate serves a server-streaming generator handler as a coroutine that writes each item:
through a real grpc.aio server, every item arrives in order, an undecodable request is refused
INVALID_ARGUMENT before the handler runs, and the handler's generator is closed (its cleanup
runs) when the client cancels the call."""
from __future__ import annotations

import asyncio
import inspect

import grpc
import pytest

from engine_common.wire.protos import generation_pb2 as pb
from scheduler_service.api.guard import Gate

METHOD = "/test.Streams/Count"


class Behaviour:
    def __init__(self):
        self.closed = asyncio.Event()
        self.calls = 0

    async def count(self, request: pb.GenerateRequest, context):
        """One response per prompt id; then waits (until the call ends) when told to."""
        self.calls += 1
        try:
            for token in request.token_ids:
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[token])
            if request.priority:           # "hang": the client cancels
                await asyncio.Event().wait()
        finally:
            self.closed.set()


def _talk(talk):
    """Run `await talk(call, behaviour)` against a fresh server with the Gate; `call(bytes)`
    starts one Count call with those request bytes. Returns what `talk` returns."""
    async def run():
        behaviour = Behaviour()
        handler = grpc.unary_stream_rpc_method_handler(
            behaviour.count, request_deserializer=pb.GenerateRequest.FromString,
            response_serializer=pb.GenerateResponse.SerializeToString)
        server = grpc.aio.server(interceptors=[Gate()])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Streams", {"Count": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_stream(
                    METHOD, request_serializer=lambda b: b,
                    response_deserializer=pb.GenerateResponse.FromString)
                return await talk(call, behaviour)
        finally:
            await server.stop(None)
    return asyncio.run(run())


def test_items_arrive_in_order_and_garbage_is_refused():
    async def talk(call, behaviour):
        got = [list(m.token_ids) async for m in call(
            pb.GenerateRequest(request_id="a", token_ids=[5, 6, 7]).SerializeToString())]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call(b"\xff\xff\xff"):
                pass
        return got, err.value, behaviour.calls

    got, error, calls = _talk(talk)
    assert got == [[5], [6], [7]]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "could not be decoded" in (
        error.details())
    assert calls == 1                      # the garbage never reached the handler


def test_a_cancelled_call_closes_the_handlers_generator():
    async def talk(call, behaviour):
        stream = call(pb.GenerateRequest(request_id="b", token_ids=[9],
                                         priority=1).SerializeToString())
        first = await stream.read()
        stream.cancel()
        await asyncio.wait_for(behaviour.closed.wait(), 30)
        return list(first.token_ids)

    assert _talk(talk) == [9]


def test_the_guarded_streaming_handler_is_a_coroutine():
    """grpc.aio runs a coroutine handler as a writer: no generator layer of the Gate's own."""
    from scheduler_service.api.guard import _stream_guard

    async def gen(request, context):
        yield request

    assert inspect.iscoroutinefunction(_stream_guard(gen, lambda r, c: None))
