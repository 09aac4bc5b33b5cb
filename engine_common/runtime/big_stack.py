"""Run a call on a fresh thread with a large stack, so a recursive native library (llguidance)
cannot overflow whatever stack the caller happens to have.

A thread's stack is what the platform gives it: 8 MiB for the main thread and (glibc, from
`ulimit -s`) for other threads here, but 2 MiB under `ulimit -s unlimited` and less elsewhere.
llguidance's grammar compiler recurses about 3 to 4 KB a level (docs/security.md); a 64 MiB
stack holds any constraint under MAX_CONSTRAINT_CHARS, and constraint depth is bounded besides
(engine_common/constraints/constraint_depth.py). The memory is reserved, not used: pages are touched only as
deep as the call goes.
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")

STACK_BYTES = 64 << 20
# threading.stack_size is process-wide: set, start, restore under one lock.
_lock = threading.Lock()


def call_with_big_stack(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a new thread with a STACK_BYTES stack; the caller waits; what it raises is
    raised here."""
    outcome: dict = {}

    def body():
        try:
            outcome["value"] = fn(*args)
        except BaseException as e:      # handed to the caller, who re-raises it
            outcome["error"] = e

    thread = threading.Thread(target=body, name="big-stack", daemon=True)
    with _lock:
        previous = threading.stack_size(STACK_BYTES)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
