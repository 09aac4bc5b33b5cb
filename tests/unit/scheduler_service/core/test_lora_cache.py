"""core/lora_cache.py: the LRU of adapters the workers hold (--max-cpu-loras)."""
from __future__ import annotations

from scheduler_service.core.lora_cache import LoRACache


def test_victim_is_the_least_recently_used_outside_the_pinned():
    cache = LoRACache(3)
    for lora_id in (1, 2, 3):
        cache.loaded(lora_id)
    assert cache.is_full() and cache.resident() == [1, 2, 3]
    cache.touch([1])                                  # 1 ran a step: most recent
    assert cache.victim(set()) == 2
    assert cache.victim({2}) == 3
    assert cache.victim({1, 2, 3}) is None            # each one in use: nothing to evict
    cache.evicted(2)
    assert cache.resident() == [3, 1] and not cache.holds(2) and cache.holds(0)
    assert (cache.num_loads, cache.num_evictions) == (3, 1)


def test_forget_and_evicting_an_id_not_held_count_nothing():
    cache = LoRACache(2)
    cache.loaded(4)
    cache.forget(4)
    cache.evicted(4)
    cache.touch([4])
    assert cache.resident() == [] and cache.num_evictions == 0
