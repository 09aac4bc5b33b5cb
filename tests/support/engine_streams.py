"""An AsyncEngine over real workers, driven by a test: one request's stream read to its end or
to the EngineUnavailable a failed step ends it with, and a scenario run on a started engine
with everything it stands on closed after."""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from engine_common.configuration.config import SchedulerConfig
from engine_common.text.tokenizer import Tokenizer
from scheduler_service.api.worker_core_factory import WorkerCoreFactory
from scheduler_service.core.request import Request
from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.engine.output_processor import OutputProcessor
from scheduler_service.errors import EngineUnavailable
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.init_specs import init_spec


def small_engine(model: str, address: str, vocab_size: int) -> tuple[AsyncEngine, WorkerClient]:
    """The real scheduler side over the worker at `address` serving `model`, small: 4
    sequences, 32 tokens a step, a 256-token context, 1 MiB of KV cache (not started)."""
    client = WorkerClient([address], connect_timeout_s=60.0, step_timeout_s=30.0)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
                             block_size=16)
    spec = init_spec(model, max_model_len=256, block_size=16, max_num_seqs=4,
                     max_num_batched_tokens=32, kv_cache_bytes=1 << 20)
    engine = AsyncEngine(WorkerCoreFactory(client, spec, config, vocab_size=vocab_size),
                         lambda: OutputProcessor(Tokenizer.from_dir(model)))
    return engine, client


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
