"""Runs the engine loop on its own thread and serves many asyncio streams from it.

The gRPC handlers live on an asyncio loop; scheduling and the blocking Step round trip live on one
engine thread. Handlers send commands (add, abort) through a queue; the thread hands outputs back
with `call_soon_threadsafe`. When a worker fails, every open stream ends with EngineUnavailable
and the thread rebuilds the core (reconnect, re-Init, new epoch) before taking new requests. When
the output of one request cannot be processed, that stream alone ends with RequestFailed.

Only the engine thread touches the core. Other threads read `stats`, an immutable snapshot the
engine thread replaces after every loop turn, and `ready`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.errors import EngineUnavailable, WorkerRefused
from scheduler_service.engine.output_processor import RequestOutput
from scheduler_service.core.request import Request

log = logging.getLogger(__name__)

_RECONNECT_SECONDS = 0.5
_REFUSED_RETRY_MAX_SECONDS = 10.0   # a refused Init is retried ever more slowly, up to this
_IDLE_WAIT_SECONDS = 0.05
_THROUGHPUT_WINDOW_SECONDS = 10.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the scheduler's load, published by the engine thread."""

    ready: bool = False
    num_waiting: int = 0
    num_running: int = 0
    num_used_blocks: int = 0     # held by live requests (free cached blocks do not count)
    num_total_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncEngine:
    """`make_core` builds a fresh EngineCore (connect + Init the workers, new epoch) or raises
    EngineUnavailable; it is retried until it succeeds. `idle_check(core)`, when given, runs on the
    engine thread every `idle_check_seconds` while no request is running and raises
    EngineUnavailable when a worker is gone, so readiness drops without waiting for a request."""

    def __init__(self, make_core: Callable[[], EngineCore],
                 idle_check: Callable[[EngineCore], None] | None = None,
                 idle_check_seconds: float = 1.0):
        self._make_core = make_core
        self._idle_check = idle_check
        self._idle_check_seconds = idle_check_seconds
        self._last_check = 0.0
        self._core: EngineCore | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._steps: deque = deque()  # (time, prompt tokens, generated tokens)
        self._steps_lock = threading.Lock()
        self.stats = EngineStats()
        self.last_error: str = "not connected to the workers yet"
        # Why the workers refused the last Init (WorkerRefused), or None after any other outcome.
        self.refused: str | None = None
        self._retry_seconds = _RECONNECT_SECONDS

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
        """Yield outputs until the request finishes. Aborts it if the caller goes away
        (cancellation, deadline) or the stream ends early for any other reason."""
        if not self.ready:
            raise EngineUnavailable(f"no worker is ready: {self.last_error}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", request, stream))
        finished = False
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True   # never added, or already dropped by the engine
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort([request.request_id])

    def abort(self, request_ids: list[str]) -> concurrent.futures.Future:
        """Abort requests (their streams end with an ABORT output). The future resolves to the
        number of ids that named a live request."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("abort", list(request_ids), done))
        return done

    def throughput(self) -> tuple[float, float]:
        """(prompt tokens/s, generated tokens/s) over the last few seconds. A prompt counts when
        its prefill completes (its first token), less the tokens the prefix cache served."""
        now = time.monotonic()
        with self._steps_lock:
            steps = [s for s in self._steps if now - s[0] <= _THROUGHPUT_WINDOW_SECONDS]
        if not steps:
            return 0.0, 0.0
        span = max(now - steps[0][0], 1e-3)
        return sum(s[1] for s in steps) / span, sum(s[2] for s in steps) / span

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._core is None and not self._connect():
                self._drain_commands(block_seconds=self._retry_seconds)
                continue
            busy = self._core.has_unfinished_requests()
            self._drain_commands(block_seconds=None if busy else _IDLE_WAIT_SECONDS)
            try:
                if self._core is not None and self._core.has_unfinished_requests():
                    outputs = self._core.step()
                    self._record_throughput(outputs)
                    self._dispatch(outputs)
                elif self._core is not None:
                    self._check_idle()
            except EngineUnavailable as e:
                self._fail_all(e)
            except Exception as e:  # a bug: fail the streams loudly, start a clean epoch
                log.exception("engine step failed")
                self._fail_all(e)
            self._publish_stats()
        self._fail_all(EngineUnavailable("the server is shutting down"))

    def _connect(self) -> bool:
        try:
            self._core = self._make_core()
        except WorkerRefused as e:
            self.last_error = self.refused = str(e)
            self._retry_seconds = min(2 * self._retry_seconds, _REFUSED_RETRY_MAX_SECONDS)
            return False
        except EngineUnavailable as e:
            self.last_error, self.refused = str(e), None
            self._retry_seconds = _RECONNECT_SECONDS
            return False
        except Exception as e:  # a bug in make_core: keep retrying, but say so loudly
            log.exception("building the engine core failed")
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        self.last_error = ""
        self.refused = None
        self._retry_seconds = _RECONNECT_SECONDS
        self._last_check = time.monotonic()
        self._publish_stats()
        log.info("engine ready")
        return True

    def _check_idle(self) -> None:
        now = time.monotonic()
        if self._idle_check is None or now - self._last_check < self._idle_check_seconds:
            return
        self._last_check = now
        self._idle_check(self._core)

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
        elif kind == "abort":
            _, request_ids, done = cmd
            ids = [rid for rid in dict.fromkeys(request_ids) if rid in self._streams]
            if self._core is not None and ids:
                self._dispatch(self._core.abort(ids))
            for rid in ids:  # aborted before any final output was produced
                self._streams.pop(rid, None)
            done.set_result(len(ids))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out if out.error is None else out.error)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: Exception) -> None:
        if self._streams:
            log.error("failing %d open streams: %s", len(self._streams), error)
        self.last_error = str(error)
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        self._core = None
        self._drain_commands(block_seconds=None)   # answer queued adds and aborts at once

    def _publish_stats(self) -> None:
        core = self._core
        if core is None:
            self.stats = EngineStats()
            return
        s = core.scheduler
        self.stats = EngineStats(
            ready=True, num_waiting=s.num_waiting, num_running=s.num_running,
            num_used_blocks=s.num_total_blocks - s.num_free_blocks,
            num_total_blocks=s.num_total_blocks, prefix_cache_hit_rate=s.prefix_cache_hit_rate)

    def _record_throughput(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        generated = prompt = 0
        for out in outputs:
            generated += len(out.new_token_ids)
            if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
                prompt += out.num_prompt_tokens - out.num_cached_tokens   # prefill just ended
        with self._steps_lock:
            self._steps.append((now, prompt, generated))
            while self._steps and now - self._steps[0][0] > _THROUGHPUT_WINDOW_SECONDS:
                self._steps.popleft()
