"""The LoRA adapters a server serves now, by name (docs/lora.md, "Loading at run time").

Each adapter has an id, its slot on the workers (1-based, the step diff's lora_id), and a
load generation, which salts the prefix cache. Ids of --lora-modules are their 1-based places
(generation = id); a runtime load takes the lowest id no adapter holds and no unfinished
request uses, and a generation no load had before. So an adapter loaded again under the same
name, even into the same slot, never hits the cached blocks of the one before it.

An unloaded adapter's id is *draining* until no unfinished request uses it; then the workers
free it (LoRAUpdates.sweep) and a later load may take it.

Lookups (`resolve`) come from the API threads; changes only from the engine thread. One lock.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from engine_common.configuration.lora import (MAX_LORA_ID, AdapterExists, AdapterNotFound,
                                              LoRAModule)
from engine_common.request.params import ParamError

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class ServedAdapter:
    """One adapter requests may name."""

    name: str
    path: str
    lora_id: int            # the workers' slot + 1
    generation: int         # salts the prefix cache; unique per load
    static: bool = False    # from --lora-modules


class LoRARegistry:
    """Name -> ServedAdapter, the draining ids, and the next generation."""

    def __init__(self, modules: tuple[LoRAModule, ...] = ()):
        self._lock = threading.Lock()
        self._by_name = {m.name: ServedAdapter(m.name, m.path, i + 1, i + 1, True)
                         for i, m in enumerate(modules)}
        self._draining: set[int] = set()
        self._next_generation = len(modules) + 1

    def adapters(self) -> list[ServedAdapter]:
        """Those requests may name, by id."""
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.lora_id)

    def resolve(self, name: str | None, field_name: str = "lora_request") -> tuple[int, int]:
        """(lora_id, generation) of adapter `name`; (0, 0) for None (the base model).
        AdapterNotFound naming the field, the value and the served names."""
        if name is None:
            return 0, 0
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise AdapterNotFound(field_name, name, f"a served LoRA adapter: {self._known()}")
            return adapter.lora_id, adapter.generation

    def _known(self):
        return sorted(self._by_name) or ("none (--enable-lora with --lora-modules, or "
                                         "LoadLoraAdapter with --allow-runtime-lora-updating)")

    def is_live(self, lora_id: int, generation: int) -> bool:
        """Whether a request resolved to (lora_id, generation) may still be queued: its
        adapter was not unloaded (or replaced) since."""
        if not lora_id:
            return True
        with self._lock:
            return any(a.lora_id == lora_id and a.generation == generation
                       for a in self._by_name.values())

    def reserve(self, name: str, path: str, ids_in_use: set[int]) -> ServedAdapter:
        """The adapter a load of `name` from `path` will serve (not served until `add`):
        the lowest id neither served, draining nor in `ids_in_use`, a new generation.
        ParamError naming the field for a bad name or path; AdapterExists for a served one."""
        check_name(name)
        if not path:
            raise ParamError("lora_path", path, "a PEFT directory on the workers")
        with self._lock:
            if name in self._by_name:
                raise AdapterExists("lora_name", name, "a name no served adapter has (unload "
                                    "it first)")
            taken = {a.lora_id for a in self._by_name.values()} | self._draining | ids_in_use
            lora_id = next(i for i in range(1, len(taken) + 2) if i not in taken)
            if lora_id > MAX_LORA_ID:
                raise ParamError("lora_name", name, f"room for it: {MAX_LORA_ID} adapter ids "
                                 "are served, draining or in use (unload one)")
            generation, self._next_generation = self._next_generation, self._next_generation + 1
            return ServedAdapter(name, path, lora_id, generation)

    def add(self, adapter: ServedAdapter) -> None:
        """Serve `adapter` (every worker holds it now)."""
        with self._lock:
            self._by_name[adapter.name] = adapter

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving `name`; its id drains. AdapterNotFound naming it when not served."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise AdapterNotFound("lora_name", name, f"a served LoRA adapter: {self._known()}")
            self._draining.add(adapter.lora_id)
            return adapter

    def drop(self, name: str) -> None:
        """Forget `name` without draining (its load failed again after a worker restart)."""
        with self._lock:
            self._by_name.pop(name, None)

    def draining(self) -> set[int]:
        with self._lock:
            return set(self._draining)

    def freed(self, lora_id: int) -> None:
        """The workers freed draining id `lora_id`: a load may take it again."""
        with self._lock:
            self._draining.discard(lora_id)


def check_name(name: str) -> None:
    """ParamError unless `name` can name an adapter: 1 to 256 printable characters, no
    whitespace (--lora-modules separates entries by whitespace)."""
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable() \
            or any(c.isspace() for c in name):
        raise ParamError("lora_name", name, f"1 to {MAX_NAME_CHARS} printable characters "
                         "without whitespace")
