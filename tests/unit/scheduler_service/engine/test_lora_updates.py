"""Runtime LoRA updates (scheduler_service/engine/lora_updates.py) against the LoRAOps seam: the
Init carries no adapter with runtime updating on, a replay after an Init loads the adapters
served *now* with their ids (an unloaded --lora-modules one never again), a --lora-modules
adapter refused at the first Init refuses the start, and a load's answer matches its state when
freeing a draining id fails. The workers' side of every call is tested over gRPC in
tests/integration/test_lora_runtime_grpc.py and tests/e2e/test_lora_worker_restart.py; here a
recording LoRAOps stands in for them, because a worker that answers LoadLora but fails the
UnloadLora just before it cannot be produced with real processes on demand."""
from __future__ import annotations

import pytest

from engine_common.configuration.config import WorkerConfig
from engine_common.configuration.lora import AdapterRefused, parse_lora_modules
from scheduler_service.core.lora_registry import LoRARegistry
from scheduler_service.engine.lora_updates import LoRAUpdates, init_config, lora_capacity
from scheduler_service.errors import WorkerFailure, WorkerRefused


class RecordingOps:
    """LoRAOps recording each call; `refuse` paths raise AdapterRefused, `fail_unload` makes
    UnloadLora a WorkerFailure (a worker that stopped answering)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.refuse: set[str] = set()
        self.fail_unload = False

    def load_lora(self, lora_id, name, path):
        if path in self.refuse:
            raise AdapterRefused(f"lora_path={path!r} is invalid: gone")
        self.calls.append(("load", lora_id, name))

    def unload_lora(self, lora_id):
        if self.fail_unload:
            raise WorkerFailure("worker 127.0.0.1:1: UnloadLora failed: stream ended",
                                "stream_ended")
        self.calls.append(("unload", lora_id))


def _updates(modules="a=/a b=/b"):
    ops = RecordingOps()
    return LoRAUpdates(LoRARegistry(parse_lora_modules(modules)), ops, allowed=True), ops


def test_init_carries_no_adapter_with_runtime_updating(tmp_path):
    kw = dict(model_dir=str(tmp_path), enable_lora=True, lora_modules="a=/a")
    sent = init_config(WorkerConfig(**kw, allow_runtime_lora_updating=True))
    assert sent.lora_modules is None and sent.max_cpu_loras == 2     # --max-loras 1 + 1
    fixed = WorkerConfig(**kw)
    assert init_config(fixed) is fixed          # without it the set never changes
    assert lora_capacity(fixed) is None


def test_the_capacity_whenever_the_init_allows_loadlora(tmp_path):
    """--max-cpu-loras when given; else, with runtime updating, the larger of --max-loras + 1
    (a slot no running request pins, for LoadLoraAdapter) and the --lora-modules (every one of
    them stays loaded, as without the flag); no LoRA, or a fixed set: none (the Init's
    --lora-modules are the set)."""
    def capacity(**kw):
        return lora_capacity(WorkerConfig(model_dir=str(tmp_path), **kw))

    three = dict(enable_lora=True, lora_modules="a=/a b=/b c=/c")
    runtime = dict(three, allow_runtime_lora_updating=True)
    assert capacity() is None and capacity(**three, max_loras=2) is None
    assert capacity(**runtime, max_loras=2) == 3
    assert capacity(**runtime, max_loras=3) == 4
    assert capacity(**runtime, max_loras=5) == 6
    assert capacity(enable_lora=True, allow_runtime_lora_updating=True, max_loras=4) == 5
    assert capacity(**runtime, max_cpu_loras=2, max_loras=2) == 2
    assert capacity(**three, max_cpu_loras=1) == 1


def test_replay_loads_the_current_set_with_ids_and_generations():
    lora, ops = _updates()
    lora.unload(set(), lambda: None, "a")             # id 1 freed at once (unused)
    c = lora.load(set(), lambda: None, "c", "/c")     # takes id 1, a new generation
    assert (c.lora_id, c.generation) == (1, 3)
    ops.calls.clear()
    ops.refuse.add("/a")                              # a's directory deleted meanwhile
    lora.replay(first=False)
    assert ops.calls == [("load", 1, "c"), ("load", 2, "b")]
    assert lora.registry.resolve("c") == (1, 3) and lora.registry.resolve("b") == (2, 2)


def test_replay_frees_draining_ids_first_and_drops_a_failing_runtime_adapter():
    lora, ops = _updates("a=/a")
    lora.load(set(), lambda: None, "c", "/c")
    lora.unload({1}, lambda: None, "a")               # a request still uses id 1: drains
    assert lora.registry.draining() == {1}
    ops.calls.clear()
    ops.refuse.add("/c")
    lora.replay()
    assert ops.calls == [("unload", 1)]
    assert lora.registry.adapters() == [] and lora.registry.draining() == set()


def test_a_refused_lora_module_refuses_the_first_init_only():
    lora, ops = _updates()
    ops.refuse.add("/b")
    with pytest.raises(WorkerRefused, match=r"--lora-modules adapter 'b': lora_path='/b'"):
        lora.replay(first=True)
    assert [a.name for a in lora.registry.adapters()] == ["a", "b"]   # still to be served
    lora.replay(first=False)                          # a later epoch: dropped, logged
    assert [a.name for a in lora.registry.adapters()] == ["a"]


def test_a_load_whose_sweep_fails_loads_nothing():
    lora, ops = _updates("a=/a")
    lora.unload({1}, lambda: None, "a")               # draining while a request uses it
    ops.fail_unload = True
    with pytest.raises(WorkerFailure):
        lora.load(set(), lambda: None, "c", "/c")     # frees id 1 first: the worker fails
    assert ops.calls == [] and lora.registry.adapters() == []   # UNAVAILABLE == not loaded


def test_an_unload_whose_sweep_fails_says_it_took_effect():
    lora, ops = _updates("a=/a")
    ops.fail_unload = True
    with pytest.raises(WorkerFailure, match=r"'a' is unloaded .* freeing its slot") as err:
        lora.unload(set(), lambda: None, "a")
    assert err.value.kind == "stream_ended"            # the metrics' kind is kept
    assert lora.registry.adapters() == [] and lora.registry.draining() == {1}


def test_max_cpu_loras_init_and_replays_load_what_the_lru_holds(tmp_path):
    """--max-cpu-loras 1 over three --lora-modules: the Init carries none and allows LoadLora;
    the first replay checks the two the LRU does not hold (loaded and freed, one at a time:
    never two held), then loads the first; a later epoch loads only what the LRU holds."""
    from scheduler_service.engine.lora_updates import lora_cache

    worker = WorkerConfig(model_dir=str(tmp_path), enable_lora=True, lora_modules="a=/a b=/b",
                          max_cpu_loras=1)
    sent = init_config(worker)
    assert sent.lora_modules is None and sent.allow_runtime_lora_updating
    assert sent.max_cpu_loras == 1
    registry = LoRARegistry(parse_lora_modules("a=/a b=/b c=/c"))
    ops = RecordingOps()
    lora = LoRAUpdates(registry, ops, allowed=False, cache=lora_cache(registry, 1))
    lora.replay(first=True)
    assert ops.calls == [("load", 2, "b"), ("unload", 2), ("load", 3, "c"), ("unload", 3),
                         ("load", 1, "a")]
    assert lora.cache.resident() == [1]
    ops.calls.clear()
    lora.replay(first=False)
    assert ops.calls == [("load", 1, "a")]
    ops.refuse.add("/c")
    with pytest.raises(WorkerRefused, match="--lora-modules adapter 'c'"):
        lora.replay(first=True)
