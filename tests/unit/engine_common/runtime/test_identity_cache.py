"""IdentityCache's rules: identity hits only, bounded, and its entries hold their keys."""
import gc
import threading
import weakref
from dataclasses import dataclass

import pytest

from engine_common.runtime.identity_cache import IdentityCache


@dataclass(frozen=True)
class _Params:
    temperature: float


def test_a_hit_needs_the_very_object_put():
    """An equal but distinct object is a miss (the callers' lru_cache behind serves value
    equality); the object put is a hit, and `in` agrees with get."""
    cache = IdentityCache(4)
    key, twin = _Params(0.5), _Params(0.5)
    assert key == twin and key is not twin
    cache.put(key, b"wire")
    assert cache.get(key) == b"wire" and key in cache
    assert cache.get(twin) is None and twin not in cache
    assert cache.get(id(key)) is None, "the id itself is not a key"


def test_falsy_values_are_hits_and_none_is_refused():
    """A greedy request's wire bytes are b"": still a hit; None could not be told from a miss."""
    cache = IdentityCache(4)
    key = _Params(0.0)
    cache.put(key, b"")
    assert cache.get(key) == b"" and key in cache
    with pytest.raises(ValueError, match="None"):
        cache.put(_Params(1.0), None)


def test_bounded_cleared_when_full_and_a_known_key_is_replaced_in_place():
    cache = IdentityCache(3)
    keys = [_Params(t) for t in range(3)]
    for k in keys:
        cache.put(k, k.temperature)
    assert len(cache) == 3
    cache.put(keys[0], "again")              # already there: no clear
    assert len(cache) == 3 and cache.get(keys[0]) == "again" and cache.get(keys[2]) == 2
    extra = _Params(9)
    cache.put(extra, 9)                      # full: everything dropped, then the new one
    assert len(cache) == 1 and cache.get(extra) == 9 and cache.get(keys[1]) is None
    with pytest.raises(ValueError):
        IdentityCache(0)


def test_an_entry_holds_its_key_so_its_id_is_not_reused():
    """The key stays alive while cached (a new object cannot take its id and hit its value);
    once cleared it can be collected."""
    cache = IdentityCache(2)
    key = _Params(0.25)
    ref = weakref.ref(key)
    cache.put(key, "row")
    del key
    gc.collect()
    assert ref() is not None and cache.get(ref()) == "row"
    cache.clear()
    gc.collect()
    assert ref() is None and len(cache) == 0


def test_get_by_id_is_get_for_a_held_object():
    """The hot paths' form answers as get does: the value for the object put, None for an
    equal twin or after a clear."""
    cache = IdentityCache(2)
    key, twin = _Params(0.5), _Params(0.5)
    cache.put(key, "row")
    assert cache.get_by_id(id(key)) == cache.get(key) == "row"
    assert cache.get_by_id(id(twin)) is None
    cache.clear()
    assert cache.get_by_id(id(key)) is None and key not in cache


class _ClearBetweenPutsWrites(dict):
    """The cache's key dict: its first write starts another thread's clear() there, between
    put's two writes, and lets it run as far as it can before put goes on."""

    def __init__(self, cache, *args):
        super().__init__(*args)
        self.cache, self.clearer = cache, None

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        if self.clearer is None:
            self.clearer = threading.Thread(target=self.cache.clear)
            self.clearer.start()
            # Done at once where nothing stops it; where put holds the cache's lock the clear
            # waits for put, and this bounded join only lets the test go on.
            self.clearer.join(timeout=1.0)


def test_a_clear_from_another_thread_never_leaves_a_value_without_its_key():
    """Another thread's clear landing inside put (two LLMs, or in-process workers, share the
    module caches) left the value with its key dropped: once the key was freed, a new object
    at its address hit that value (another request's sampling bytes, a knob check skipped).
    Afterwards every value's key is held."""
    cache = IdentityCache(4)
    keys = _ClearBetweenPutsWrites(cache, cache._keys)
    cache._keys = keys
    key = _Params(0.5)
    cache.put(key, b"wire")
    keys.clearer.join()
    held = {k for k in keys}
    assert all(k in held for k in list(cache._values)), "a value outlived its key"
    assert cache.get(key) in (None, b"wire")
