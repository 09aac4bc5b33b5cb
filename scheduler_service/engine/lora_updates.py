"""LoRA adapters loaded and unloaded at run time (docs/lora.md, "Loading at run time"), on the
engine thread, between steps.

    load    the name checked and an id reserved (core/lora_registry.py), the steps in flight
            collected, every worker rank loads the directory; only then may requests name it
    unload  the name stops resolving at once (new requests: NOT_FOUND); requests already
            queued or running with it finish with it (vLLM's behaviour); its id drains
    sweep   a draining id no unfinished request uses is freed on the workers (after every
            engine turn that finds one, and at each load and unload)
    replay  after every Init (a new epoch), every adapter served *now* is loaded with its id,
            the --lora-modules ones too, and draining ids freed: a restarted worker process
            holds none of them, and the Init carries none (init_config), so an adapter
            unloaded since the start is never sent again (its directory may be gone)

`ops` changes the workers' slots: WorkerLoRA (gRPC) or the in-process runner (deltaserve.llm).
With runtime updating or --max-cpu-loras the workers hold only the adapters of `cache`
(core/lora_cache.py, capacity lora_capacity()): a load
evicts the least recently used one no request uses, replay loads only those held, and
engine/lora_residency.py loads a waiting request's adapter again before it runs.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Protocol

from engine_common.configuration.config import BatchLimits, WorkerConfig
from scheduler_service.core.lora_cache import LoRACache
from scheduler_service.core.lora_registry import LoRARegistry, ServedAdapter
from scheduler_service.errors import (AdaptersBusy, EngineUnavailable, LoRAUpdatesOff,
                                     WorkerRefused)

log = logging.getLogger(__name__)

FLAG = "--allow-runtime-lora-updating"


def lora_capacity(config: BatchLimits) -> int | None:
    """The adapters every worker rank may hold at once when its Init allows LoadLora (runtime
    updating or --max-cpu-loras): --max-cpu-loras, by default the larger of --max-loras + 1
    and the number of --lora-modules. Running requests use at most --max-loras adapters, so
    the spare slot lets a LoadLoraAdapter always evict one (vLLM's load never fails for room:
    its running adapters keep their GPU slots); the --lora-modules all stay loaded, as without
    runtime updating, so turning it on does not read them from disk at each switch. None when
    the Init carries the --lora-modules and allows no LoadLora: that set never grows."""
    if not config.enable_lora or not (config.allow_runtime_lora_updating
                                      or config.max_cpu_loras is not None):
        return None
    if config.max_cpu_loras is not None:
        return config.max_cpu_loras
    return max(config.max_loras + 1, len(config.lora))


def init_config(worker: WorkerConfig) -> WorkerConfig:
    """What the workers' Init carries: when LoadLora is allowed (lora_capacity), no adapter
    (replay loads the adapters held now by LoadLora, each with its id) and the capacity as
    max_cpu_loras, so each rank's memory check counts exactly the slots it may hold and it
    refuses more; otherwise --lora-modules as given."""
    capacity = lora_capacity(worker)
    if capacity is None:
        return worker
    return dataclasses.replace(worker, lora_modules=None, allow_runtime_lora_updating=True,
                               max_cpu_loras=capacity)


def lora_cache(registry: LoRARegistry, capacity: int | None) -> LoRACache | None:
    """None without a capacity (lora_capacity); else an LRU holding the first `capacity`
    adapters of --lora-modules (the first replay loads them)."""
    if capacity is None:
        return None
    cache = LoRACache(capacity)
    for adapter in registry.adapters()[:capacity]:
        cache.loaded(adapter.lora_id)
    return cache


class LoRAOps(Protocol):
    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Every rank holds the adapter in slot lora_id - 1, or none does (raises)."""

    def unload_lora(self, lora_id: int) -> None:
        """Every rank frees slot lora_id - 1."""


class LoRAUpdates:
    """The runtime loads of one server: its registry, the workers' ops, the flag."""

    def __init__(self, registry: LoRARegistry, ops: LoRAOps, allowed: bool,
                 cache: LoRACache | None = None):
        self.registry, self.ops, self.allowed, self.cache = registry, ops, allowed, cache
        # id -> (name, path) of every adapter the workers may have to load again (served or
        # draining): a queued request of an unloaded adapter still runs with it
        self.sources = {a.lora_id: (a.name, a.path) for a in registry.adapters()}

    def check_allowed(self, call: str) -> None:
        """LoRAUpdatesOff naming the flag unless the server was started with it."""
        if not self.allowed:
            raise LoRAUpdatesOff(f"{call}: runtime LoRA updating is off: start the server "
                                 f"with --enable-lora {FLAG}")

    def load(self, in_use: set[int], drain: Callable[[], object], name: str, path: str,
             pinned: Callable[[], set[int]] | None = None) -> ServedAdapter:
        """Load `name` from `path` on every rank, then serve it. `in_use`: the adapter ids of
        unfinished requests; `drain()` collects the steps in flight; `pinned()` (after the
        drain; None: `in_use`): the ids --max-cpu-loras may not evict for it, the running
        requests' (a waiting request's adapter is read again before it runs:
        lora_residency.py; vLLM's LRU evicts the oldest).
        The answer is the state: draining ids are freed *before* the load (a failure there
        answers UNAVAILABLE with nothing loaded), and once the workers hold the adapter
        nothing else can fail."""
        self.check_allowed("LoadLoraAdapter")
        adapter = self.registry.reserve(name, path, in_use)
        self.sweep(in_use, drain)
        drain()
        self._make_room(in_use if pinned is None else pinned(), name)
        self.ops.load_lora(adapter.lora_id, name, path)
        self._loaded(adapter.lora_id, name, path)
        self.registry.add(adapter)
        log.info("LoRA adapter %r loaded from %s (id %d, generation %d)", name, path,
                 adapter.lora_id, adapter.generation)
        return adapter

    def _make_room(self, pinned: set[int], name: str) -> None:
        """With --max-cpu-loras and every slot taken: evict the least recently used adapter
        outside `pinned`; AdaptersBusy (RESOURCE_EXHAUSTED) naming the flag when each one is
        pinned."""
        if self.cache is None or not self.cache.is_full():
            return
        victim = self.cache.victim(pinned)
        if victim is None:
            raise AdaptersBusy("lora_name", name, f"room for it: --max-cpu-loras="
                             f"{self.cache.capacity} adapters are loaded and each is in use "
                             "by a running request")
        self.ops.unload_lora(victim)
        self.cache.evicted(victim)

    def _loaded(self, lora_id: int, name: str, path: str) -> None:
        self.sources[lora_id] = (name, path)
        if self.cache is not None:
            self.cache.loaded(lora_id)

    def unload(self, in_use: set[int], drain: Callable[[], object], name: str) -> None:
        """Stop serving `name`; its id is freed on the workers once no request uses it. When
        freeing it fails (a worker died: UNAVAILABLE, the workers start a new epoch), the
        error says the unload itself took effect."""
        self.check_allowed("UnloadLoraAdapter")
        adapter = self.registry.remove(name)
        log.info("LoRA adapter %r unloaded (id %d)", name, adapter.lora_id)
        try:
            self.sweep(in_use, drain)
        except EngineUnavailable as e:     # same type and kind (metrics), truer message
            e.args = (f"LoRA adapter {name!r} is unloaded (requests naming it get NOT_FOUND), "
                      f"but freeing its slot on the workers failed: {e}",)
            raise

    def can_sweep(self, in_use: set[int]) -> bool:
        """A draining id no request uses: sweep() has work."""
        return bool(self.registry.draining() - in_use)

    def sweep(self, in_use: set[int], drain: Callable[[], object]) -> None:
        """Free on the workers every draining id no unfinished request uses."""
        free = sorted(self.registry.draining() - in_use)
        if not free:
            return
        drain()
        for lora_id in free:
            if self.cache is None or self.cache.holds(lora_id):
                self.ops.unload_lora(lora_id)
            if self.cache is not None:
                self.cache.forget(lora_id)
            self.sources.pop(lora_id, None)
            self.registry.freed(lora_id)

    def replay(self, first: bool = False) -> None:
        """After an Init: the draining ids freed (nothing runs in a new epoch), then every
        adapter served now loaded again with its id and generation (init_config sent none;
        with --max-cpu-loras those the LRU holds). One whose directory fails now is no longer
        served (logged); on the `first` Init an adapter of --lora-modules that fails is
        WorkerRefused, as vLLM refuses to start: with --max-cpu-loras the ones the LRU does
        not hold are loaded and freed again first, one at a time, to check them."""
        self.sweep(set(), lambda: None)
        adapters = self.registry.adapters()
        held = [a for a in adapters if self.cache is None or self.cache.holds(a.lora_id)]
        if first:
            for adapter in (a for a in adapters if a.static and a not in held):
                if self._load_again(adapter, first):
                    self.ops.unload_lora(adapter.lora_id)
        for adapter in held:
            self._load_again(adapter, first)

    def _load_again(self, adapter: ServedAdapter, first: bool) -> bool:
        """Load a served adapter into its id; False (and no longer served) when it fails."""
        try:
            self.ops.load_lora(adapter.lora_id, adapter.name, adapter.path)
            return True
        except EngineUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - the directory changed since: drop it
            if first and adapter.static:
                raise WorkerRefused(f"--lora-modules adapter {adapter.name!r}: {e}") from e
            log.error("LoRA adapter %r is no longer served: loading it again after the "
                      "workers' Init failed: %s", adapter.name, e)
            self.registry.drop(adapter.name)
            if self.cache is not None:
                self.cache.forget(adapter.lora_id)
            return False

    def on_turn(self, engine) -> None:
        """The AsyncEngine's end-of-turn hook (engine thread): when a draining id is no longer
        used, sweep it on the engine thread's next turn."""
        core = engine.core
        if not self.allowed or core is None or not self.registry.draining():
            return
        if self.can_sweep(core.scheduler.lora_ids_in_use()):
            engine.call_on_engine(
                lambda c, drain: self.sweep(c.scheduler.lora_ids_in_use(), drain))
