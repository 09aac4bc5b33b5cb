"""A worker that refuses the Init settings (INVALID_ARGUMENT) is a WorkerRefused: the engine
records why, retries ever more slowly instead of at its reconnect pace, and forgets it on another
outcome. (The worker-side mapping is tested in tests/test_worker_service.py.) The engine loop
runs with a scripted core factory and a tiny reconnect pause here; the pacing is read from the
engine's backoff at each try, not from the clock."""
from __future__ import annotations

import threading

from scheduler_service.engine.async_engine import AsyncEngine
from scheduler_service.errors import WorkerFailure, WorkerRefused

RECONNECT_S = 0.01


def test_engine_retries_a_refusal_slowly_and_forgets_it_after_another_outcome():
    backoffs: list[float] = []          # the engine's retry pause when each try starts
    accept = threading.Event()          # from then on: "not reachable", not a refusal
    four_refused, second_plain = threading.Event(), threading.Event()
    plain = []
    engine: AsyncEngine

    def make_core():
        backoffs.append(engine._retry_seconds)
        if len(backoffs) == 4:
            four_refused.set()
        if not accept.is_set():
            raise WorkerRefused("worker w: Init failed: INVALID_ARGUMENT: bad dtype")
        plain.append(len(backoffs) - 1)
        if len(plain) == 2:            # the engine has handled the first plain failure
            second_plain.set()
        raise WorkerFailure("worker w: not reachable")   # not a refusal: retried at its pace

    engine = AsyncEngine(make_core, make_output_processor=lambda: None,   # no stream opens
                         reconnect_seconds=RECONNECT_S)
    engine.start()
    try:
        assert four_refused.wait(30)
        assert engine.refused and "bad dtype" in engine.refused
        accept.set()
        assert second_plain.wait(30)
        assert engine.refused is None and "not reachable" in engine.last_error
    finally:
        engine.shutdown()
    # Each refusal doubles the pause (0.5 s -> 1 -> 2 ... by default; 10 s at most).
    assert backoffs[:4] == [RECONNECT_S, 2 * RECONNECT_S, 4 * RECONNECT_S, 8 * RECONNECT_S]
    # A failure that is not a refusal goes back to the reconnect pace.
    assert backoffs[plain[1]] == RECONNECT_S, backoffs
