"""An AsyncEngine over real workers, driven by a test: one request's stream read to its end or
to the EngineUnavailable a failed step ends it with, and a scenario run on a started engine
with everything it stands on closed after."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from scheduler_service.core.request import Request
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.errors import EngineUnavailable


async def stream_ids(engine: AsyncEngine, request: Request, started: asyncio.Event | None = None):
    """(the request's token ids, the EngineUnavailable its stream ended with or None); sets
    `started` at its first output."""
    ids = []
    try:
        async for out in engine.generate(request):
            ids += out.new_token_ids
            if started is not None:
                started.set()
    except EngineUnavailable as e:
        return ids, e
    return ids, None


def run_started(engine: AsyncEngine, scenario: Callable[[], Awaitable], timeout_s: float,
                *closables) -> None:
    """Starts `engine`, runs `scenario()` within timeout_s, then shuts the engine down and
    closes each of `closables` (client, proxy, processes) in order, whatever happened."""
    try:
        engine.start()
        asyncio.run(asyncio.wait_for(scenario(), timeout_s))
    finally:
        engine.shutdown()
        for thing in closables:
            thing.close()
