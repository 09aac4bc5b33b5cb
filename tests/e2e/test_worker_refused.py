"""A worker that refuses the Init settings (INVALID_ARGUMENT) is a WorkerRefused: the engine
records why, retries ever more slowly instead of every half second, and forgets it on success.
(The worker-side mapping is tested in tests/test_worker_service.py.) The engine loop runs with a
scripted core factory here, for the retry pacing."""
from __future__ import annotations

import threading
import time

from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.errors import WorkerFailure, WorkerRefused


def test_engine_retries_a_refusal_slowly_and_forgets_it_after_another_outcome():
    calls: list[float] = []
    accept = threading.Event()

    def make_core():
        calls.append(time.monotonic())
        if not accept.is_set():
            raise WorkerRefused("worker w: Init failed: INVALID_ARGUMENT: bad dtype")
        raise WorkerFailure("worker w: not reachable")   # not a refusal: retried at once

    engine = AsyncEngine(make_core, make_output_processor=lambda: None)   # no stream opens
    engine.start()
    try:
        time.sleep(3.2)
        assert engine.refused and "bad dtype" in engine.refused
        # Backoff 0.5 -> 1 -> 2 s after the first try: about 3 tries in 3.2 s, not 7.
        assert 2 <= len(calls) <= 4, calls
        accept.set()
        deadline = time.monotonic() + 15
        while engine.refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.refused is None and "not reachable" in engine.last_error
    finally:
        engine.shutdown()
