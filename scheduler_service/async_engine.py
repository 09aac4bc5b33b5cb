"""Runs the engine loop on its own thread and serves many asyncio streams from it.

The gRPC handlers live on an asyncio loop; scheduling and the blocking Step round trip live on one
engine thread. Handlers send commands (add, abort) through a queue; the thread hands outputs back
with `call_soon_threadsafe`. When a worker fails, every open stream ends with EngineUnavailable
and the thread rebuilds the core (reconnect, re-Init, new epoch) before taking new requests.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from scheduler_service.engine_core import EngineCore
from scheduler_service.errors import EngineUnavailable
from scheduler_service.output_processor import RequestOutput
from scheduler_service.request import Request

log = logging.getLogger(__name__)

_RECONNECT_SECONDS = 0.5
_THROUGHPUT_WINDOW_SECONDS = 10.0


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncEngine:
    def __init__(self, make_core: Callable[[], EngineCore]):
        self._make_core = make_core
        self._core: EngineCore | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._steps: deque = deque()  # (time, prompt tokens, generated tokens)
        self.last_error: str = "not connected to the workers yet"

    # -- called from the asyncio side -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    @property
    def ready(self) -> bool:
        return self._core is not None

    @property
    def core(self) -> EngineCore | None:
        return self._core

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes. Aborts it if the caller goes away."""
        if not self.ready:
            raise EngineUnavailable(f"no worker is ready: {self.last_error}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", request, stream))
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort([request.request_id])

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", list(request_ids)))

    def throughput(self) -> tuple[float, float]:
        """(prompt tokens/s, generated tokens/s) over the last few seconds."""
        steps = list(self._steps)
        if not steps:
            return 0.0, 0.0
        span = max(time.monotonic() - steps[0][0], 1e-3)
        return sum(s[1] for s in steps) / span, sum(s[2] for s in steps) / span

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._core is None and not self._connect():
                self._drain_commands(block_seconds=_RECONNECT_SECONDS)
                continue
            busy = self._core.has_unfinished_requests()
            self._drain_commands(block_seconds=None if busy else 0.05)
            if self._core is None or not self._core.has_unfinished_requests():
                continue
            try:
                outputs = self._core.step()
            except EngineUnavailable as e:
                self._fail_all(e)
                continue
            self._record_throughput(outputs)
            self._dispatch(outputs)

    def _connect(self) -> bool:
        try:
            self._core = self._make_core()
            self.last_error = ""
            log.info("engine ready")
            return True
        except EngineUnavailable as e:
            self.last_error = str(e)
            return False

    def _drain_commands(self, block_seconds: float | None) -> None:
        try:
            cmd = (self._commands.get(timeout=block_seconds) if block_seconds
                   else self._commands.get_nowait())
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request, stream = cmd
            if self._core is None:
                stream.put(EngineUnavailable(f"no worker is ready: {self.last_error}"))
                return
            try:
                self._core.add_request(request)
            except ValueError as e:  # rejected: the API layer maps the subclass to a status
                stream.put(e)
                return
            self._streams[request.request_id] = stream
        elif kind == "abort" and self._core is not None:
            ids = [rid for rid in cmd[1] if rid in self._streams]
            self._dispatch(self._core.abort(ids))
            for rid in ids:  # aborted before any final output was produced
                self._streams.pop(rid, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: EngineUnavailable) -> None:
        log.error("worker failure, failing %d open streams: %s", len(self._streams), error)
        self.last_error = str(error)
        for stream in self._streams.values():
            stream.put(EngineUnavailable(str(error)))
        self._streams.clear()
        self._core = None

    def _record_throughput(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        generated = sum(len(o.new_token_ids) for o in outputs)
        self._steps.append((now, 0, generated))
        while self._steps and now - self._steps[0][0] > _THROUGHPUT_WINDOW_SECONDS:
            self._steps.popleft()
