"""Which LoRA adapters the workers hold now, with --max-cpu-loras (vLLM's): an LRU of at most
`capacity` adapter ids (docs/lora.md, "Adapters the workers keep").

Every served adapter keeps its name and id (core/lora_registry.py); only `capacity` of them are
loaded on the workers. The scheduler admits a request only when its adapter is loaded
(Scheduler.lora_cache); before a step the engine makes the adapters waiting requests want
loaded, evicting the least recently used one no running request uses
(engine/lora_residency.py). The decision is made once, here, and reaches every rank as the same
LoadLora / UnloadLora calls: ranks never decide on their own.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class LoRACache:
    """Adapter ids loaded on the workers, least recently used first; counters for metrics."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._ids: OrderedDict[int, None] = OrderedDict()
        self.num_loads = 0          # loads this cache asked for (re-reads included)
        self.num_evictions = 0      # adapters it unloaded to make room

    def holds(self, lora_id: int) -> bool:
        """Whether adapter `lora_id` is loaded on the workers (0, the base model: always)."""
        return not lora_id or lora_id in self._ids

    def resident(self) -> list[int]:
        """The loaded ids, least recently used first."""
        return list(self._ids)

    def is_full(self) -> bool:
        return len(self._ids) >= self.capacity

    def touch(self, lora_ids: Iterable[int]) -> None:
        """These adapters ran a step: most recently used now."""
        for lora_id in lora_ids:
            if lora_id in self._ids:
                self._ids.move_to_end(lora_id)

    def victim(self, pinned: set[int]) -> int | None:
        """The least recently used loaded id outside `pinned` (the running requests'), or
        None when every loaded adapter is pinned."""
        return next((i for i in self._ids if i not in pinned), None)

    def loaded(self, lora_id: int) -> None:
        """The workers hold `lora_id` now (most recently used)."""
        self._ids[lora_id] = None
        self._ids.move_to_end(lora_id)
        self.num_loads += 1

    def evicted(self, lora_id: int) -> None:
        """The workers freed `lora_id` to make room."""
        if self._ids.pop(lora_id, False) is None:
            self.num_evictions += 1

    def forget(self, lora_id: int) -> None:
        """The workers freed `lora_id` for another reason (an unloaded adapter, a new epoch)."""
        self._ids.pop(lora_id, None)
