"""Small integer handles that name requests on the wire; freed handles are reused lowest first."""
from __future__ import annotations

import heapq


class HandleAllocator:
    """Hands out 0, 1, 2, ... and reuses released handles, smallest first (keeps them small)."""

    def __init__(self):
        self._next = 0
        self._released: list[int] = []   # min-heap
        self._in_use: set[int] = set()

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    def allocate(self) -> int:
        if self._released:
            handle = heapq.heappop(self._released)
        else:
            handle = self._next
            self._next += 1
        self._in_use.add(handle)
        return handle

    def release(self, handle: int) -> None:
        if handle not in self._in_use:
            raise ValueError(f"handle {handle} released but not in use")
        self._in_use.remove(handle)
        heapq.heappush(self._released, handle)
