"""Requests in flight per API key, across both services of the public port.

The waiting queue is shared (--max-waiting): without a bound per key, one tenant that sends
--max-waiting requests leaves every other tenant RESOURCE_EXHAUSTED until its own are done.
With --max-requests-per-key N a key holds at most N requests at once, queued or running (a
VllmEngine Generate with n choices holds n), and its next one is refused with
RESOURCE_EXHAUSTED naming the limit; other keys are not affected. Without API keys every call is
the same caller, so the bound is then one for the whole port.

Calls that wait holding their message but no place are bounded per key too (`call`), by kind:
a Classify or Score call's requests wait for places of their key (scoring.py) while it holds
its texts' token ids, and a Tokenize call waits for the key's share of the tokenizer threads.
A key holds at most N calls of each kind at once, so what its waiting calls hold is bounded.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from scheduler_service.core.admission import QueueFull

# The kinds of calls `RequestQuota.call` bounds (its message names them).
CLASSIFY_SCORE = "Classify and Score"
TOKENIZE = "Tokenize"


class RequestQuota:
    """`per_key`: requests one caller may hold at once (None: no bound). Used from the event
    loop only (no lock)."""

    def __init__(self, per_key: int | None = None):
        self.per_key = per_key
        self._live: Counter[str] = Counter()
        self._waiters: dict[str, list[asyncio.Future]] = {}   # caller -> wait_place calls
        self._calls: Counter[tuple[str, str]] = Counter()     # (caller, kind) -> calls

    def live(self, caller: str) -> int:
        return self._live[caller]

    def calls(self, caller: str, kind: str = CLASSIFY_SCORE) -> int:
        """`caller`'s calls of `kind` in progress."""
        return self._calls[caller, kind]

    @contextmanager
    def call(self, caller: str, request_id: str, kind: str = CLASSIFY_SCORE
             ) -> Iterator[None]:
        """One call of `kind` by `caller` while the block runs; QueueFull when the key holds
        its bound of them already (taken before the call tokenizes anything)."""
        held = self._calls[caller, kind]
        if self.per_key is not None and held >= self.per_key:
            raise QueueFull(request_id, f"{kind} calls in progress for this API key", held + 1,
                            f"<= {self.per_key} (--max-requests-per-key)")
        self._calls[caller, kind] = held + 1
        try:
            yield
        finally:
            self._calls[caller, kind] -= 1
            if not self._calls[caller, kind]:
                del self._calls[caller, kind]

    async def wait_place(self, caller: str) -> None:
        """Return once `caller` holds fewer places than the bound, so a `hold` of one made
        before the next await succeeds (a Classify / Score call's next request waits for a
        place rather than failing)."""
        while self.per_key is not None and self._live[caller] >= self.per_key:
            freed = asyncio.get_running_loop().create_future()
            waiters = self._waiters.setdefault(caller, [])
            waiters.append(freed)
            try:
                await freed
            finally:
                if freed in waiters:
                    waiters.remove(freed)
                if not waiters:
                    self._waiters.pop(caller, None)

    @contextmanager
    def hold(self, caller: str, request_id: str, n: int = 1) -> Iterator[None]:
        """Hold n of `caller`'s places while the block runs; QueueFull when they would pass the
        bound."""
        held = self._live[caller]
        if self.per_key is not None and held + n > self.per_key:
            raise QueueFull(request_id, "requests in flight for this API key", held + n,
                            f"<= {self.per_key} (--max-requests-per-key)")
        self._live[caller] = held + n
        try:
            yield
        finally:
            self._live[caller] -= n
            if not self._live[caller]:
                del self._live[caller]
            for freed in self._waiters.get(caller, ()):     # each looks again
                if not freed.done():
                    freed.set_result(None)
