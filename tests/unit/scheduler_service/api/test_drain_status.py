"""A stream still open when the drain's grace period ends gets the engine's status
(UNAVAILABLE "the server is shutting down"), not gRPC's bare "Cancelling all calls".

SchedulerServer.stop used to stop the gRPC server first (which cancels what is left after the
grace period) and the engine after it, so the engine's failure of those streams reached nobody:
`deltaserve generate` through SIGTERM printed "UNAVAILABLE: Cancelling all calls". Here the
engine's shutdown is what ends the open stream, as the real engine's does."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler_service.api.server import SchedulerServer

METHOD = "/test.Streams/Hang"


class _Engine:
    """Fails the open stream on shutdown, from the thread stop() calls it on."""

    def __init__(self, loop: asyncio.AbstractEventLoop, failed: asyncio.Event):
        self.loop, self.failed, self.shutdowns = loop, failed, 0

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.loop.call_soon_threadsafe(self.failed.set)


class _Readiness:
    async def drain(self) -> None:
        pass


class _Client:
    def close(self) -> None:
        pass


async def _hanging_app(grace_period_s: float):
    """A SchedulerServer whose one method streams until the engine's shutdown fails it, as the
    real engine's does; returns it, its port, the engine and the event set once a call hangs."""
    failed, started = asyncio.Event(), asyncio.Event()

    async def hang(request, context):
        started.set()
        await failed.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        yield b""      # never reached: makes this a stream handler

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Streams", {"Hang": grpc.unary_stream_rpc_method_handler(hang)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    engine = _Engine(asyncio.get_running_loop(), failed)
    app = SchedulerServer(server, engine, _Readiness(), _Client(), port,
                          grace_period_s=grace_period_s)
    return app, port, engine, started


async def _stop_with_a_stream_open(grace_period_s: float, hurry: asyncio.Event | None):
    """The error the hanging stream ends with when the app stops, and the engine's shutdowns."""
    app, port, engine, started = await _hanging_app(grace_period_s)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reading = asyncio.ensure_future(channel.unary_stream(METHOD)(b"").read())
        await started.wait()
        stopping = asyncio.ensure_future(app.stop(hurry=hurry))
        if hurry is not None:
            hurry.set()
        await asyncio.wait_for(stopping, 120)   # bounds a failure (a 600 s grace)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reading
    return err.value, engine.shutdowns


def test_a_stream_open_past_the_grace_period_gets_the_engines_status():
    error, shutdowns = asyncio.run(_stop_with_a_stream_open(0.0, None))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "the server is shutting down"
    assert shutdowns >= 1


def test_a_second_ctrl_c_ends_a_long_grace_period_at_once():
    """`hurry` (serve's second SIGINT) fails the open streams now instead of after 600 s."""
    error, _ = asyncio.run(_stop_with_a_stream_open(600.0, asyncio.Event()))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error.details() == "the server is shutting down"
