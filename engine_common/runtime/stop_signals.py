"""Waiting in the main thread for SIGINT / SIGTERM, safely whichever thread the kernel hands the
signal to and however many come.

When `deltaserve serve` is killed, its worker gets one SIGTERM per thread of serve that exits
(PR_SET_PDEATHSIG fires each time the child is handed to another thread: 2 to 13 counted), in
a burst. Python runs a handler in the main thread between two bytecodes, also inside a handler
still running, so the handler takes no lock: one that called `threading.Event.set()` was
re-entered inside `Event.set` and blocked forever on the lock its outer call held (the worker
outlived its killed parent, ~1 run in 20), and one that treated any second signal as "exit now"
skipped the graceful stop. So a repeated SIGTERM is ignored (the stop has a watchdog); only a
second Ctrl-C (SIGINT) exits at once. The wait blocks in `select` on the signal wakeup fd, which
the C-level handler writes from whichever thread took the signal, so it wakes at once.
"""
from __future__ import annotations

import os
import select
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The longest a signal could wait if its wakeup byte were lost (the pipe full: never expected).
_POLL_SECONDS = 0.5


class StopSignals:
    """Installs SIGINT / SIGTERM handlers (main thread only); `wait()` returns once one came.
    A second SIGINT after the first exits at once with code 1 (a user's second Ctrl-C)."""

    def __init__(self, poll_s: float = _POLL_SECONDS):
        self.received: int | None = None
        self._poll_s = poll_s
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd)
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def _on_signal(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signum          # no lock: see the module docstring
        elif signum == signal.SIGINT:       # a second Ctrl-C: do not wait any longer
            os._exit(1)

    def wait(self) -> int:
        """Blocks until a stop signal was handled; returns its number."""
        while self.received is None:
            select.select([self._read_fd], [], [], self._poll_s)
            try:
                os.read(self._read_fd, 512)   # drain; the handler runs before the next check
            except BlockingIOError:
                pass
        return self.received

    def restore(self) -> None:
        """Puts back the handlers and wakeup fd that were there before (a later signal is
        then handled as before this object)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)
