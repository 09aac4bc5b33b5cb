"""At most one log line per interval for a kind of event an outsider can repeat at will (issue 23:
refused worker calls logged 7,000 WARNING lines in 5 s), saying how many were left out.

    limit = LogLimit(interval_s=10.0)
    if (skipped := limit.take()) is not None:
        log.warning("refused %s (and %d more since the last report)", what, skipped)
"""
from __future__ import annotations

import threading
import time
from typing import Callable


class LogLimit:
    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()      # called from the server's pool threads
        self._next = float("-inf")
        self._skipped = 0

    def take(self) -> int | None:
        """None when this event is not to be logged; else how many were left out before it."""
        with self._lock:
            now = self._clock()
            if now < self._next:
                self._skipped += 1
                return None
            skipped, self._skipped = self._skipped, 0
            self._next = now + self.interval_s
            return skipped
