"""IdentityCache: values remembered by the identity of the object they were computed from.

A decoded prefill diff shares one frozen SamplingParams object per distinct message, so its
hundreds of new requests find their derived value (wire bytes, a knob check, a batch row) by
`id()` instead of hashing every field of the dataclass per request, as an lru_cache would.

Rules: a hit needs the very object that was put (an equal but distinct object is a miss: the
callers keep a value-keyed lru_cache behind this one for that); the entry holds a reference to
its key, so the key's id cannot be reused by another object while it is cached; at most
`max_entries` entries, all dropped at once when full (the working set is a few kinds of
sampling, so a rare full clear costs less than LRU bookkeeping per hit).
"""
from __future__ import annotations


class IdentityCache:
    """id(key) -> (key, value), bounded; see the module docstring."""

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries}: expected at least 1")
        self._entries: dict[int, tuple[object, object]] = {}
        self.max_entries = max_entries

    def get(self, key: object):
        """The value put for this very object, or None."""
        hit = self._entries.get(id(key))
        return hit[1] if hit is not None and hit[0] is key else None

    def put(self, key: object, value: object) -> None:
        """Remember `value` for `key` (None is not a value: get could not tell it from a miss)."""
        if value is None:
            raise ValueError("IdentityCache cannot hold None")
        entries = self._entries
        if len(entries) >= self.max_entries and id(key) not in entries:
            entries.clear()
        entries[id(key)] = (key, value)       # holding key keeps its id from reuse

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
