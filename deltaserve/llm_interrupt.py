"""Ctrl-C during an offline call, taken between engine steps. A KeyboardInterrupt raised inside
a step (after the scheduler counted it and before the runner took it, or half way through the
scheduler's own update) left the two disagreeing: every later step of that LLM failed ("step N
arrived after step M"). A second Ctrl-C raises at once, as before (a step that never ends), and
the LLM then starts its scheduler and runner over (LLM._start_over), so that it stays usable.

Only on the main thread, and only while SIGINT has Python's default handler: a handler of the
caller's own is left alone.
"""
from __future__ import annotations

import signal
import threading


class DeferredInterrupt:
    """`with DeferredInterrupt() as ctrl_c:` ... `ctrl_c.check()` at each safe point raises the
    KeyboardInterrupt of a Ctrl-C pressed since; leaving the block normally raises it too (the
    call was interrupted, even if its last step then finished)."""

    def __init__(self):
        self.pressed = False
        self.taken = False               # check() raised: the Ctrl-C landed at a safe point
        self._installed = False

    def __enter__(self) -> DeferredInterrupt:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True
        return self

    def _on_sigint(self, _signum, _frame) -> None:
        self.pressed = True
        self._restore()                  # a second Ctrl-C raises where it lands

    def _restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False

    def check(self) -> None:
        if self.pressed:
            self.pressed = False
            self.taken = True
            raise KeyboardInterrupt

    def __exit__(self, exc_type, _exc, _tb) -> None:
        self._restore()
        if exc_type is None:
            self.check()
