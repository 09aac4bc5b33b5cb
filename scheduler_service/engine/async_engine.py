"""Runs the engine loop on its own thread and serves many asyncio streams from it.

The gRPC handlers live on an asyncio loop; scheduling and the blocking Step round trip live on one
engine thread, which deals in token ids only. Handlers send commands (add, abort, call: a
function run between steps) through a queue; the thread hands each loop turn's TokenUpdates to
the loop in ONE `call_soon_threadsafe` (per event loop with streams: stream_routes.py). The
loop's StreamHub does the text work (detokenization, stop strings) and sends back, in one
`finish` command, the requests a stop string ended: the engine finishes them (frees their
blocks) at its next turn. A token the engine computed for such a request meanwhile never reaches
the client.

When a worker fails, every open stream ends with EngineUnavailable and the thread rebuilds the
core (reconnect, re-Init, new epoch) before taking new requests. When the output of one request
cannot be processed, that stream alone ends with RequestFailed and the engine aborts it. When
another scheduler took the workers over (Fenced), the engine stops for good: it never rebuilds
the core, and every request gets UNAVAILABLE naming the new owner.

A prefix-cache flush (`flush_prefix_cache`) waits on the engine thread until no request is
running (or its timeout passes): cached blocks can only be forgotten while no request holds one
(prefix_flushes.py).

The thread steps while the core `has_work()`: that includes finished requests the workers have
not heard of, so an engine going idle sends them in a step that computes nothing.

Only the engine thread touches the core; only a hub's loop touches that hub. Other threads read
`stats`, an immutable snapshot the engine thread replaces after every loop turn, and `ready`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.engine_stats import EngineStats
from scheduler_service.engine.metrics import SchedulerMetrics
from scheduler_service.engine.output_processor import OutputProcessor, RequestOutput
from scheduler_service.engine.prefix_flushes import PendingFlushes
from scheduler_service.engine.stream_hub import (MAX_MERGED_STEPS, StreamError, StreamHub,
                                                 coalesce)
from scheduler_service.engine.stream_routes import StreamRoutes
from scheduler_service.engine.serving_counters import ServingCounters
from scheduler_service.errors import EngineFault, EngineUnavailable, Fenced, WorkerRefused

log = logging.getLogger(__name__)

_RECONNECT_SECONDS = 0.5
_REFUSED_RETRY_MAX_SECONDS = 10.0   # a refused Init is retried ever more slowly, up to this
_IDLE_WAIT_SECONDS = 0.05


class AsyncEngine:
    """`make_core` builds a fresh EngineCore (connect + Init the workers, new epoch) or raises
    EngineUnavailable; it is retried until it succeeds. `make_output_processor` builds the text
    side of one event loop. `idle_check(core)`, when given, runs on the engine thread every
    `idle_check_seconds` while no request is running and raises EngineUnavailable when a worker
    is gone, so readiness drops without waiting for a request. `metrics` records the steps,
    epochs, failures and streams (a private SchedulerMetrics when not given); `counters` are the
    streams' request and token counts. `on_turn()`, when given, runs on the engine thread at the
    end of every loop turn (the KV event publisher hands the turn's events on there).
    `reconnect_seconds` is the pause between tries to build a core (tests make it tiny);
    `clock` times the idle checks and the flushes' deadlines (tests inject one)."""

    def __init__(self, make_core: Callable[[], EngineCore],
                 make_output_processor: Callable[[], OutputProcessor],
                 idle_check: Callable[[EngineCore], None] | None = None,
                 idle_check_seconds: float = 1.0, metrics: SchedulerMetrics | None = None,
                 on_turn: Callable[[], object] | None = None,
                 reconnect_seconds: float = _RECONNECT_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self._make_core = make_core
        self._clock = clock
        self._reconnect_seconds = reconnect_seconds
        self._on_turn = on_turn
        self._make_output_processor = make_output_processor
        self._idle_check = idle_check
        self._idle_check_seconds = idle_check_seconds
        self._last_check = 0.0
        self._core: EngineCore | None = None
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # Engine thread only: the hub of every request in the core, and this turn's hand-offs.
        self._routes = StreamRoutes()
        self._hubs: dict[asyncio.AbstractEventLoop, StreamHub] = {}
        self._hubs_lock = threading.Lock()
        self.counters = ServingCounters()
        self.metrics = metrics or SchedulerMetrics("")
        self.stats = EngineStats()
        self.last_error: str = "not connected to the workers yet"
        # Why the workers refused the last Init (WorkerRefused), or None after any other outcome.
        self.refused: str | None = None
        # Why this engine stopped for good: another scheduler took the workers over.
        self.fenced: str | None = None
        self._retry_seconds = reconnect_seconds
        # Set while a core is built (`ready`): lets waiters block instead of polling.
        self._ready = threading.Event()
        # Engine thread only: flushes waiting for the engine to go idle.
        self._flushes = PendingFlushes()

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

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until a core is built (`ready`); False if `timeout_s` passes first."""
        return self._ready.wait(timeout_s)

    @property
    def core(self) -> EngineCore | None:
        return self._core

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes: one per engine step, or, when the caller
        reads slower than the engine steps, the waiting steps' outputs merged, up to
        MAX_MERGED_STEPS in one (as vLLM's output collector does; each message costs the event
        loop ~70 us of gRPC work at 128 streams, which then does not grow with the lag). Aborts the request if the caller
        goes away (cancellation, deadline) or the stream ends early for any other reason."""
        if not self.ready:
            raise EngineUnavailable(f"no worker is ready: {self.last_error}")
        hub = self._hub(asyncio.get_running_loop())
        box = hub.open(request)
        self._commands.put(("add", request, hub))
        finished = False
        try:
            while not finished:
                # A consumer that fell behind gets the steps waiting for it as one output.
                for item in coalesce(await box.take(), MAX_MERGED_STEPS):
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

    def flush_prefix_cache(self, timeout_s: float) -> concurrent.futures.Future:
        """Forget every cached prompt block once no request is running: at once when the engine
        is idle, else as soon as it goes idle within `timeout_s` seconds (0: only if idle now).
        The future resolves to (flushed, message); the message says why when not flushed."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("flush", timeout_s, done))
        return done

    def call_on_engine(self, fn: Callable) -> concurrent.futures.Future:
        """Run fn(core, drain) on the engine thread between steps (LoRA loads: docs/lora.md);
        `drain()` first collects the steps in flight. The future resolves to its result or
        error; an EngineUnavailable it raises also fails the streams, as a step's would."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, done))
        return done

    def throughput(self) -> tuple[float, float]:
        """(prompt tokens/s less prefix-cache hits, generated tokens/s) streamed over the last
        few seconds."""
        return self.counters.rates()

    def _hub(self, loop: asyncio.AbstractEventLoop) -> StreamHub:
        with self._hubs_lock:
            hub = self._hubs.get(loop)
            if hub is None:
                self._hubs = {k: v for k, v in self._hubs.items() if not k.is_closed()}
                hub = StreamHub(loop, self._make_output_processor(), self._finish_command,
                                self.counters, self.metrics)
                self._hubs[loop] = hub
            return hub

    def _finish_command(self, request_ids: list[str], status: RequestStatus) -> None:
        self._commands.put(("finish", request_ids, status))

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.fenced is not None:
                self._drain_commands(block_seconds=self._reconnect_seconds)
                self._routes.hand_off()
                self._serve_flushes()
                continue
            if self._core is None and not self._connect():
                self._drain_commands(block_seconds=self._retry_seconds)
                self._routes.hand_off()
                self._serve_flushes()
                continue
            busy = self._core.has_work()     # finished ids to send count (engine_core.py)
            self._drain_commands(block_seconds=None if busy else _IDLE_WAIT_SECONDS)
            self._routes.hand_off()       # aborts and rejections need not wait for the step
            try:
                if self._core is not None and self._core.has_work():
                    self._step()
                elif self._core is not None:
                    self._check_idle()
            except EngineUnavailable as e:
                self.metrics.observe_failure(e)
                self._fail_all(e)
            except Exception as e:  # a bug: fail the streams loudly, start a clean epoch
                log.exception("engine step failed")
                self.metrics.observe_failure(e)
                self._fail_all(EngineFault(e))   # its text to the log only
            self._publish_stats()
            self._routes.hand_off()
            self._serve_flushes()
            self._end_turn()
        self._fail_all(EngineUnavailable("the server is shutting down"))
        self._routes.hand_off()
        self._serve_flushes()

    def _end_turn(self) -> None:
        if self._on_turn is None:
            return
        try:
            self._on_turn()
        except Exception:  # a bug there must not stop the engine
            log.exception("on_turn failed")

    def _connect(self) -> bool:
        try:
            self._core = self._make_core()
        except Fenced as e:
            self._stop_fenced(e)
            return False
        except WorkerRefused as e:
            self.last_error = self.refused = str(e)
            self._retry_seconds = min(2 * self._retry_seconds, _REFUSED_RETRY_MAX_SECONDS)
            return False
        except EngineUnavailable as e:
            self.last_error, self.refused = str(e), None
            self._retry_seconds = self._reconnect_seconds
            return False
        except Exception as e:  # a bug in make_core: keep retrying, but say so loudly
            log.exception("building the engine core failed")
            self.last_error = f"{type(e).__name__}: {e}"
            return False
        self.last_error = ""
        self.refused = None
        self._retry_seconds = self._reconnect_seconds
        self._ready.set()
        self._last_check = self._clock()
        self.metrics.observe_epoch()
        self._publish_stats()
        log.info("engine ready")
        return True

    def _step(self) -> None:
        core = self._core
        self._routes.route(core.step())
        spec = core.scheduler.spec
        self.metrics.observe_step(core.last_step, core.scheduler.kv.stats,
                                  None if spec is None else spec.stats)

    def _check_idle(self) -> None:
        now = self._clock()
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
            self._add(cmd[1], cmd[2])
        elif kind == "abort":
            _, request_ids, done = cmd
            ids = [rid for rid in dict.fromkeys(request_ids) if rid in self._routes]
            if self._core is not None and ids:
                self._routes.route(self._core.abort(ids))
            for rid in ids:  # aborted before any final update was produced
                self._routes.close(rid)
            done.set_result(len(ids))
        elif kind == "flush":
            _, timeout_s, done = cmd
            self._flushes.add(self._clock() + timeout_s, timeout_s, done)
        elif kind == "call":
            self._call(cmd[1], cmd[2])
        elif kind == "finish":   # the serving side ended these (stop string, failed output)
            _, request_ids, status = cmd
            ids = [rid for rid in request_ids if self._routes.close(rid)]
            if self._core is not None and ids:
                self._core.scheduler.finish_requests(ids, status)

    def _call(self, fn: Callable, done: concurrent.futures.Future) -> None:
        if self._core is None:
            done.set_exception(EngineUnavailable(f"no worker is ready: {self.last_error}"))
            return
        core = self._core
        try:
            done.set_result(fn(core, lambda: self._routes.route(core.drain_in_flight())))
        except EngineUnavailable as e:
            done.set_exception(e)
            self.metrics.observe_failure(e)
            self._fail_all(e)
        except Exception as e:  # noqa: BLE001 - the caller's to report (a refused load)
            done.set_exception(e)

    def _add(self, request: Request, hub: StreamHub) -> None:
        rid = request.request_id
        if self._core is None:
            self._routes.post(hub, StreamError(rid, EngineUnavailable(
                f"no worker is ready: {self.last_error}")))
            return
        try:
            self._core.add_request(request)
        except ValueError as e:  # rejected: the API layer maps the subclass to a status
            self._routes.post(hub, StreamError(rid, e))
            return
        self._routes.open(rid, hub)

    def _serve_flushes(self) -> None:
        self._flushes.serve(self._core, self._clock, self.last_error)

    def _stop_fenced(self, error: Fenced) -> None:
        if self.fenced is None:
            log.error("this scheduler stops driving the workers: %s", error)
            self.fenced = ("this scheduler stopped: another scheduler took the workers over "
                           f"({error})")
        self.last_error = self.fenced

    def _fail_all(self, error: Exception) -> None:
        # Not ready *before* any stream hears of the failure: a caller that reacts to its
        # stream's error must not see `ready` still True and send a request into the old core.
        self._ready.clear()
        self._core = None
        self.last_error = str(error)
        if isinstance(error, Fenced):
            self._stop_fenced(error)
        if self._routes:
            log.error("failing %d open streams: %s", len(self._routes), error)
        self._routes.fail_all(error)
        self._drain_commands(block_seconds=None)   # answer queued adds and aborts at once

    def _publish_stats(self) -> None:
        core = self._core
        if core is None:
            self.stats = EngineStats()
            return
        s = core.scheduler
        used_window, total_window = s.window_blocks     # a hybrid model's; (0, 0) else
        lru = s.lora_cache                              # --max-cpu-loras; None else
        self.stats = EngineStats(
            ready=True, num_waiting=s.num_waiting, num_running=s.num_running,
            num_used_blocks=s.num_total_blocks - s.num_free_blocks,
            num_total_blocks=s.num_total_blocks, prefix_cache_hit_rate=s.prefix_cache_hit_rate,
            num_steps_in_flight=core.num_steps_in_flight,
            max_steps_in_flight=core.max_steps_in_flight,
            num_used_window_blocks=used_window, num_total_window_blocks=total_window,
            num_loras_loaded=0 if lru is None else len(lru.resident()),
            num_lora_loads=0 if lru is None else lru.num_loads,
            num_lora_evictions=0 if lru is None else lru.num_evictions)

