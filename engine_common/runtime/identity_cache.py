"""IdentityCache: values remembered by the identity of the object they were computed from.

A decoded prefill diff shares one frozen SamplingParams object per distinct message, so its
hundreds of new requests find their derived value (wire bytes, a knob check, a batch row) by
`id()` instead of hashing every field of the dataclass per request, as an lru_cache would.

Rules: a hit needs the very object that was put (an equal but distinct object is a miss: the
callers keep a value-keyed lru_cache behind this one for that); the entry holds a reference to
its key, so the key's id cannot be reused by another object while it is cached; at most
`max_entries` entries, all dropped at once when full (the working set is a few kinds of
sampling, so a rare full clear costs less than LRU bookkeeping per hit). Thread-safe: put and
clear (a miss's work) take a lock; a hit takes none.
"""
from __future__ import annotations

import threading


class IdentityCache:
    """id(key) -> value, bounded, each key held; see the module docstring.

    Holding the key is what makes its id a safe key: two live objects never share an id, so
    while an entry exists its id names that very object, and no `is` check is needed on a hit.
    get_by_id is the hot paths' form (the dict's own C get: no Python frame per request), for
    id() of an object the caller holds."""

    __slots__ = ("_values", "_keys", "_lock", "max_entries", "get_by_id")

    def __init__(self, max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: expected at least 1")
        self._values: dict[int, object] = {}
        self._keys: dict[int, object] = {}       # holding each key keeps its id from reuse
        # put's two writes and clear's two must not interleave: a clear between them left a
        # value whose key was dropped, and once that key was freed a new object at its
        # address hit the value (the module caches are shared by every thread that encodes,
        # checks or batches: two LLMs, in-process workers).
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.get_by_id = self._values.get

    def get(self, key: object):
        """The value put for this very object, or None."""
        return self._values.get(id(key))

    def put(self, key: object, value: object) -> None:
        """Remember `value` for `key` (None is not a value: get could not tell it from a miss)."""
        if value is None:
            raise ValueError("IdentityCache cannot hold None")
        k = id(key)
        with self._lock:
            if len(self._values) >= self.max_entries and k not in self._values:
                self._clear()
            self._keys[k] = key
            self._values[k] = value

    def __contains__(self, key: object) -> bool:
        return id(key) in self._values

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._values.clear()     # values first: a hit never finds a value whose key is gone
        self._keys.clear()
