"""Requests in flight per API key, across both services of the public port.

The waiting queue is shared (--max-waiting): without a bound per key, one tenant that sends
--max-waiting requests leaves every other tenant RESOURCE_EXHAUSTED until its own are done.
With --max-requests-per-key N a key holds at most N requests at once, queued or running (a
VllmEngine Generate with n choices holds n), and its next one is refused with
RESOURCE_EXHAUSTED naming the limit; other keys are not affected. Without API keys every call is
the same caller, so the bound is then one for the whole port.

Nothing waits for a place: every call that needs one (Generate, Embed, a Classify or Score
call's window of them: scoring.py) takes it at once or is refused, as a gateway's rate limit
answers 429 at once. A Tokenize call holds no place but waits for the key's share of the
tokenizer threads holding its message, so a key holds at most N of them at once (`call`).
So does each kind of stream a client keeps open as long as it likes (health Watch, VllmEngine
GetTokenizer and SubscribeKvEvents): at most N of each per key, the next RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from scheduler_service.core.admission import QueueFull

# The kinds of calls `RequestQuota.call` bounds (its message names them): Tokenize, and the
# streams a client may keep open for as long as it likes, which hold no request place.
TOKENIZE = "Tokenize"
WATCH = "Watch"                                  # grpc.health.v1
GET_TOKENIZER = "GetTokenizer"                   # VllmEngine
SUBSCRIBE_KV_EVENTS = "SubscribeKvEvents"        # VllmEngine, admin keys only


class RequestQuota:
    """`per_key`: requests one caller may hold at once (None: no bound). Used from the event
    loop only (no lock)."""

    def __init__(self, per_key: int | None = None):
        self.per_key = per_key
        self._live: Counter[str] = Counter()
        self._calls: Counter[tuple[str, str]] = Counter()     # (caller, kind) -> calls

    def live(self, caller: str) -> int:
        return self._live[caller]

    def calls(self, caller: str, kind: str = TOKENIZE) -> int:
        """`caller`'s calls of `kind` in progress."""
        return self._calls[caller, kind]

    @contextmanager
    def call(self, caller: str, request_id: str, kind: str = TOKENIZE) -> Iterator[None]:
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
