"""The queue of requests waiting to be (re)admitted to the running batch.

Order: lower `priority` value first; within a priority, preempted requests first (they already
hold outputs and a worker-side cache entry), then earlier arrival (FCFS).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import count

from scheduler_service.core.request import Request, RequestStatus


class WaitingQueue:
    """A sorted list of requests; small enough (max_waiting) for O(n) inserts and removals."""

    def __init__(self):
        self._keys: list[tuple] = []
        self._requests: list[Request] = []
        self._seq = count()   # tie-break: insertion order

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))

    def push(self, request: Request) -> None:
        preempted = request.status == RequestStatus.PREEMPTED
        key = (request.priority, not preempted, request.arrival_time, next(self._seq))
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._requests.insert(i, request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self.pop_at(0)

    def at(self, i: int) -> Request:
        """The i-th request in queue order (0: the head)."""
        return self._requests[i]

    def pop_at(self, i: int) -> Request:
        del self._keys[i]
        return self._requests.pop(i)

    def remove(self, request: Request) -> bool:
        """Remove by identity; False when the request is not queued."""
        for i, r in enumerate(self._requests):
            if r is request:
                del self._keys[i]
                del self._requests[i]
                return True
        return False
