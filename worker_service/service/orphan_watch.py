"""The owner's Step stream that ended: when the worker stops keeping its requests.

A scheduler that dies (killed, its host gone) ends its Step stream with a cancellation and sends
nothing more; the worker kept every cached request, its batch rows and its KV (the tenants'
prompts and outputs) until the next Init, which may never come. The rule (docs/security.md,
"A vanished owner"):

- Only the stream that ran the current epoch's latest step counts: a superseded stream, a stream
  refused at its first step (an old owner's STALE_EPOCH after a takeover), a stream that never
  stepped, change nothing.
- When it ends (a cancellation, an error, or the scheduler closing it), the epoch has the grace
  (ORPHAN_GRACE_S, the worker's --worker-orphan-grace) to go on: a new Step stream of the same
  epoch that runs a step within it (a scheduler may reconnect with the epoch's stream key; the
  worker lets a newer stream of the current epoch take over) keeps everything, and so does an
  Init or Reset (which drop everything themselves).
- Otherwise the node worker drops every cached request on every rank, zeroes the KV cache
  (step/owner_scrub.py) and ends the epoch: a later step of it fails EPOCH_FAILED naming why;
  the scheduler must Init (or Reset) again.

vLLM and SGLang keep nothing for a client that is gone either: vLLM aborts a request whose
client disconnected and its worker processes exit when their parent's death pipe closes; SGLang's
scheduler process exits when its parent dies.

Time is injected: `call_later(delay_s, fn)` runs `fn` once after `delay_s` (a daemon timer; a
test's records it and calls it itself).
"""
from __future__ import annotations

import threading
from typing import Callable

ORPHAN_GRACE_S = 60.0     # the default of the worker's --worker-orphan-grace

Key = tuple[int, int]        # (epoch, stream id)


def timer_call_later(delay_s: float, fn: Callable[[], None]) -> None:
    timer = threading.Timer(delay_s, fn)
    timer.daemon = True
    timer.name = "orphan-watch"
    timer.start()


class OrphanWatch:
    """Which stream runs the current epoch, and which ended one awaits its grace. Thread-safe
    (its own lock: a stream's end never waits behind a model load)."""

    def __init__(self, grace_s: float = ORPHAN_GRACE_S,
                 call_later: Callable[[float, Callable[[], None]], None] = timer_call_later):
        self.grace_s = grace_s
        self.call_later = call_later
        self._lock = threading.Lock()
        self._stepping: Key | None = None      # the stream that ran the epoch's latest step
        self._ended: Key | None = None         # that stream, once it ended

    def stepped(self, epoch: int, stream_id: int) -> None:
        """A step of `stream_id` ran (or is admitted) in `epoch`: any pending drop is off."""
        with self._lock:
            self._stepping, self._ended = (epoch, stream_id), None

    def new_epoch(self) -> None:
        """Init or Reset started an epoch: nothing of the last one is pending."""
        with self._lock:
            self._stepping = self._ended = None

    def ended(self, stream_id: int, on_grace_over: Callable[[Key], None]) -> None:
        """Stream `stream_id` ended; when it ran the epoch's latest step, call
        `on_grace_over(key)` after the grace (it asks `due(key)` whether it still applies)."""
        with self._lock:
            if self._stepping is None or self._stepping[1] != stream_id:
                return
            key = self._ended = self._stepping
        self.call_later(self.grace_s, lambda: on_grace_over(key))

    def due(self, key: Key) -> bool:
        """Whether the drop for `key` still applies (no step, Init or Reset since); consumes it."""
        with self._lock:
            if self._ended != key:
                return False
            self._stepping = self._ended = None
            return True
