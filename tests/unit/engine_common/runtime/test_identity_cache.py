"""IdentityCache's rules: identity hits only, bounded, and its entries hold their keys."""
import gc
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
