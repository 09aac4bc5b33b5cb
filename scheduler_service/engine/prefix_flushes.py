"""Prefix-cache flushes waiting for the engine to go idle (AsyncEngine.flush_prefix_cache).

Cached blocks can only be forgotten while no request holds one, so a flush asked for while
requests run waits, up to its timeout, for a turn of the engine thread with none. Engine thread
only."""
from __future__ import annotations

import concurrent.futures
from typing import Callable

from scheduler_service.engine.engine_core import EngineCore


class PendingFlushes:
    """The flushes not answered yet: (deadline, timeout, future resolving to (flushed, message))."""

    def __init__(self):
        self._waiting: list[tuple[float, float, concurrent.futures.Future]] = []

    def add(self, deadline: float, timeout_s: float, done: concurrent.futures.Future) -> None:
        self._waiting.append((deadline, timeout_s, done))

    def serve(self, core: EngineCore | None, clock: Callable[[], float], last_error: str) -> None:
        """Answer the waiting flushes: while requests run, only those past their deadline (not
        flushed); otherwise all of them at once, with one reset (or none: no worker ready,
        `last_error` says why)."""
        if not self._waiting:
            return
        if core is not None and core.has_unfinished_requests():
            now = clock()
            late = [f for f in self._waiting if f[0] <= now]
            self._waiting = [f for f in self._waiting if f[0] > now]
            busy = core.scheduler.num_running + core.scheduler.num_waiting
            for _, timeout_s, done in late:
                done.set_result((False, f"not flushed after {timeout_s:g} s: requests still "
                                        f"running or waiting ({busy})"))
            return
        if core is None:
            answer = (False, f"not flushed: no worker is ready: {last_error}")
        elif core.scheduler.kv.reset_prefix_cache():
            answer = (True, "prefix cache flushed")
        else:
            answer = (False, "not flushed: KV blocks are still held")
        for _, _, done in self._waiting:
            done.set_result(answer)
        self._waiting = []
