"""Hands the prefix cache's events (core/kv_events.py) from the engine thread to subscribers on
asyncio loops.

    engine thread, once per loop turn:  publish()  takes the feed's events; when there are any,
                                        numbers them as one KvEventBatch and gives it to every
                                        subscriber with ONE call_soon_threadsafe each
    asyncio side:                       async for batch in publisher.subscribe(): ...

So a step that stores or evicts many blocks costs one wake-up per subscriber, not one per event.
The feed records only while someone is subscribed. Sequence numbers start at 1 and grow by one
per batch published while anyone listens; there is no replay: a subscriber gets the batches
published after it subscribed. A subscriber that falls more than `max_backlog` batches behind is
dropped (its stream ends with SubscriberLagging) rather than letting memory grow without bound.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from scheduler_service.core.kv_events import KvEvent, KvEventFeed

_DEFAULT_MAX_BACKLOG = 4096


@dataclass(frozen=True)
class KvEventBatch:
    sequence_number: int
    timestamp: float          # seconds since the epoch, when the engine thread published it
    events: tuple[KvEvent, ...]
    first_event_id: int = 1   # events are numbered consecutively across batches, from 1


class SubscriberLagging(RuntimeError):
    """A subscriber did not keep up with the engine; its stream ends so it can resubscribe."""


class _Subscriber:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_backlog: int):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.max_backlog = max_backlog
        self.dropped = False

    def deliver(self, batch: KvEventBatch) -> None:
        """On the subscriber's loop."""
        if self.dropped:
            return
        if self.queue.qsize() >= self.max_backlog:
            self.dropped = True
            self.queue.put_nowait(SubscriberLagging(
                f"KV event subscriber fell {self.max_backlog} batches behind; resubscribe"))
            return
        self.queue.put_nowait(batch)


class KvEventPublisher:
    """One per engine: the feed the scheduler records into, and the subscribers."""

    def __init__(self, feed: KvEventFeed | None = None, max_backlog: int = _DEFAULT_MAX_BACKLOG):
        self.feed = feed or KvEventFeed()
        self._max_backlog = max_backlog
        # Guards the subscriber list; notified when it changes (wait_subscribers).
        self._lock = threading.Condition(threading.Lock())
        self._subscribers: list[_Subscriber] = []
        self._sequence = 0
        self._next_event_id = 1

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def wait_subscribers(self, n: int, timeout: float) -> bool:
        """Until exactly `n` subscribers listen (a caller whose events must not be published
        before its subscriber is in); False if not within `timeout` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._subscribers) == n, timeout)

    def publish(self) -> KvEventBatch | None:
        """Engine thread: hand this turn's events to every subscriber; returns the batch."""
        events = self.feed.take()
        if not events:
            return None
        with self._lock:
            subscribers = list(self._subscribers)
        if not subscribers:
            return None
        self._sequence += 1
        batch = KvEventBatch(self._sequence, time.time(), tuple(events), self._next_event_id)
        self._next_event_id += len(events)
        for sub in subscribers:
            try:
                sub.loop.call_soon_threadsafe(sub.deliver, batch)
            except RuntimeError:   # its loop is closed: nobody reads it any more
                self._remove(sub)
        return batch

    async def subscribe(self) -> AsyncIterator[KvEventBatch]:
        """Yield every batch published from now on, until the caller stops iterating."""
        sub = _Subscriber(asyncio.get_running_loop(), self._max_backlog)
        with self._lock:
            self._subscribers.append(sub)
            self.feed.enabled = True
            self._lock.notify_all()
        try:
            while True:
                item = await sub.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._remove(sub)

    def _remove(self, sub: _Subscriber) -> None:
        with self._lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)
            self.feed.enabled = bool(self._subscribers)
            self._lock.notify_all()
