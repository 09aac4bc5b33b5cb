"""Before a step, with --max-cpu-loras: load the adapters waiting requests want, evicting the
least recently used ones no running request uses (docs/lora.md, "Adapters the workers keep").

EngineCore.step calls it between steps, with nothing in flight (it collects the steps in
flight first), so every rank gets the same LoadLora / UnloadLora calls at the same point of
the step sequence: the decision is the scheduler's, made once.
"""
from __future__ import annotations

import logging

from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.lora_updates import LoRAUpdates
from scheduler_service.errors import EngineUnavailable

log = logging.getLogger(__name__)


def wants_loads(updates: LoRAUpdates | None, scheduler: Scheduler) -> bool:
    """Whether a waiting request's adapter is not loaded and there is room, or a victim."""
    if updates is None or updates.cache is None:
        return False
    wanted = scheduler.lora_ids_wanted()
    cache = updates.cache
    return bool(wanted) and (not cache.is_full() or cache.victim(_pinned(scheduler)) is not None)


def _pinned(scheduler: Scheduler) -> set[int]:
    """Adapters never evicted now: the running requests', and those of the waiting requests
    ahead of the first whose adapter is not loaded (they are admitted before it)."""
    pinned = scheduler.lora_ids_running()
    for request in scheduler.waiting:
        if not scheduler.lora_cache.holds(request.lora_id):
            break
        pinned.add(request.lora_id)
    return pinned


def make_resident(updates: LoRAUpdates, scheduler: Scheduler) -> list[str]:
    """Load the wanted adapters, in queue order, while there is room or a victim (_pinned).
    Returns the ids of the waiting requests whose adapter can no longer be read (its
    directory changed since): the caller finishes them; the adapter stops being served."""
    cache, pinned = updates.cache, _pinned(scheduler)
    failed: list[int] = []
    for lora_id in scheduler.lora_ids_wanted():
        if cache.is_full():
            victim = cache.victim(pinned)
            if victim is None:
                break
            updates.ops.unload_lora(victim)
            cache.evicted(victim)
        name, path = updates.sources.get(lora_id, (f"id {lora_id}", ""))
        try:
            if not path:           # never loaded by this scheduler: nothing to read
                raise LookupError(f"no directory is known for LoRA adapter id {lora_id}")
            updates.ops.load_lora(lora_id, name, path)
        except EngineUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - its directory changed since it was served
            log.error("LoRA adapter %r (id %d) is no longer served: loading it again from %s "
                      "failed: %s", name, lora_id, path, e)
            _stop_serving(updates, name, lora_id)
            failed.append(lora_id)
            continue
        cache.loaded(lora_id)
        pinned.add(lora_id)           # never evicted for the next one of this pass
    return [r.request_id for r in scheduler.waiting if r.lora_id in failed]


def _stop_serving(updates: LoRAUpdates, name: str, lora_id: int) -> None:
    served = {a.name: a for a in updates.registry.adapters()}
    if name in served and served[name].lora_id == lora_id:
        updates.registry.remove(name)          # drains: freed once its requests finish
