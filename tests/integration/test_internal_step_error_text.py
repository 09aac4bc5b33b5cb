"""A worker's INTERNAL StepError reaches every open stream without its text.

A failed step ends every open stream, every tenant's, with one message. An INTERNAL StepError
carries the runner's exception text (up to 2,000 characters), which a model or grammar bug can
fill with one request's data: before, every stream read it (`... step 3 failed: INTERNAL:
RuntimeError: <its text>`), and so did later refusals (`last_error`). Now the streams get the
code only, and the text stays in the worker's log and the scheduler's.

A real worker service on loopback in this process (tiny model, one in-process rank, so the
test can make its runner raise), the real scheduler side (WorkerClient over gRPC, EngineCore,
AsyncEngine), two tenants' streams open when the runner raises with a secret in its message."""
from __future__ import annotations

import asyncio
import logging

import grpc

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.model_files.model_dir import ModelInfo
from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.security.worker_auth import WorkerAuth
from scheduler_service.api.status import status_for
from scheduler_service.core.request import Request
from scheduler_service.errors import EngineUnavailable
from tests.support.engine_streams import run_started, small_engine, stream_ids
from worker_service.runner.model_runner import ModelRunner
from worker_service.service.server import serve_worker

SECRET = "tenant-b-prompt: the merger closes on 3 March at 41.5 per share"


class _Server:
    """serve_worker's server, closable as run_started closes things."""

    def __init__(self):
        self.server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"),
                                   WorkerAuth())
        self.address = f"127.0.0.1:{self.server.bound_port}"

    def close(self) -> None:
        self.server.stop(None)
        self.server.node_worker.close()


def test_an_internal_step_error_reaches_the_streams_without_its_text(tiny_models, monkeypatch,
                                                                       caplog):
    caplog.set_level(logging.WARNING)
    model = tiny_models("qwen3")
    info = ModelInfo.from_dir(model)
    armed = []
    execute = ModelRunner.execute

    def failing(runner, payload):
        if armed:       # a runner bug whose message quotes a request
            raise RuntimeError(f"row 1 of the batch does not fit: {SECRET!r}")
        return execute(runner, payload)
    monkeypatch.setattr(ModelRunner, "execute", failing)

    worker = _Server()
    engine, client = small_engine(model, worker.address, info.vocab_size)

    def request(rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt, SamplingParams(),
                       StoppingParams(max_tokens=200, ignore_eos=True), info.eos_token_ids)

    results = {}

    async def scenario():
        assert await asyncio.to_thread(engine.wait_ready, 120), engine.last_error
        prompts = {"tenant-a": [3, 14, 15, 92, 65], "tenant-b": [2, 71, 82, 81]}
        started = {name: asyncio.Event() for name in prompts}
        runs = [asyncio.ensure_future(stream_ids(engine, request(name, p), started[name]))
                for name, p in prompts.items()]
        for event in started.values():
            await event.wait()
        armed.append(True)
        results["streams"] = await asyncio.wait_for(asyncio.gather(*runs), 120)
        results["last_error"] = engine.last_error

    run_started(engine, scenario, 300, client, worker)
    for ids, error in results["streams"]:
        assert isinstance(error, EngineUnavailable), (ids, error)
        code, message = status_for(error)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert "failed: INTERNAL (the worker's runner failed" in message, message
        assert SECRET not in message and "merger" not in message, message
    assert "merger" not in results["last_error"], results["last_error"]
    # The operator still has it: the worker's log (its traceback) and the scheduler's.
    worker_side = [r for r in caplog.records if r.name.startswith("worker_service")]
    scheduler_side = [r for r in caplog.records if r.name.startswith("scheduler_service")]
    assert any(SECRET in _text(r) for r in worker_side), [r.name for r in worker_side]
    assert any(SECRET in _text(r) for r in scheduler_side), [r.name for r in scheduler_side]


def _text(record: logging.LogRecord) -> str:
    return record.getMessage() + (logging.Formatter().formatException(record.exc_info)
                                  if record.exc_info else "")
