"""--max-cpu-loras (docs/lora.md, "Adapters the workers keep"): more adapters served than the
workers keep loaded. Requests cycling through them give the tokens of a server without the
limit; the runner never holds more than the limit (its real slots, checked at every change);
an adapter a running request uses is never evicted; an adapter whose directory is gone when it
must be read again stops being served and its queued requests end; a request of an evicted
adapter is served under a storm of other adapters' requests and aborts (sync and async), with
nothing leaked, and still served once unloaded while its request was queued."""
from __future__ import annotations

import shutil

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from scheduler_service.core.request import RequestStatus
from scheduler_service.errors import WorkerRefused
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.lora_adapters import make_adapter

NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    model = tiny_models("llama")
    root = tmp_path_factory.mktemp("lora-lru")
    adapters = {n: make_adapter(model, root / n, r=4, alpha=16, seed=i + 1)
                for i, n in enumerate(NAMES)}
    return model, adapters


def _llm(model, adapters, **kw) -> LLM:
    mods = " ".join(f"{n}={p}" for n, p in adapters.items())
    return LLM(model, dtype="float32", num_kv_blocks=256, enable_lora=True, lora_modules=mods,
               **kw)


def _held_spy(llm: LLM) -> list[int]:
    """The number of adapters the runner holds after each change of its slots."""
    slots, counts = llm.runner.lora, []
    apply = slots._apply

    def spy(adapters):
        apply(adapters)
        counts.append(len(slots.adapters))

    slots._apply = spy
    return counts


def _generate(llm, prompts, names, max_tokens):
    outs = llm.generate(prompts, SamplingParams(),
                        StoppingParams(max_tokens=max_tokens, ignore_eos=True),
                        lora_request=list(names))
    assert_no_leaked_blocks(llm)
    return [o.token_ids for o in outs]


def _prompts(n: int) -> list[list[int]]:
    return [[5 + i, 9, 11 + 2 * i, 13, 7 + i] for i in range(n)]


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(1, 1), (1, 2), (2, 2)])
def test_cycling_adapters_match_no_limit(setup, max_loras, max_cpu_loras):
    model, adapters = setup
    names = ["a", "b", "c", None, "c", "a", "b", "b", "a", "c"]
    prompts = _prompts(len(names))
    want = _generate(_llm(model, adapters, max_loras=max_loras), prompts, names, 6)
    llm = _llm(model, adapters, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    assert len(llm.runner.lora.adapters) == max_cpu_loras       # the first ones, at start
    held = _held_spy(llm)
    assert _generate(llm, prompts, names, 6) == want
    assert held and max(held) <= max_cpu_loras, held
    cache = llm._lora.cache
    assert cache.num_evictions > 0 and cache.num_loads > len(NAMES)    # re-read from disk
    # the adapters differ: a cache that served the wrong one would change the tokens
    assert len({tuple(want[i]) for i in (0, 1, 2, 3)}) == 4


def test_an_adapter_in_use_is_never_evicted(setup):
    """'a' decodes 40 tokens while b and c take turns in the other slot of two: every
    eviction picks an adapter no running request uses, so 'a' is never evicted (nor read
    again), though it is the least recently loaded."""
    model, adapters = setup
    names = ["a"] + ["b", "c"] * 3
    prompts = _prompts(len(names))
    stopping = [StoppingParams(max_tokens=40 if n == "a" else 3, ignore_eos=True)
                for n in names]

    def run(llm):
        outs = llm.generate(prompts, SamplingParams(), stopping, lora_request=names)
        assert_no_leaked_blocks(llm)
        return [o.token_ids for o in outs]

    want = run(_llm(model, adapters, max_loras=2))
    llm = _llm(model, adapters, max_loras=2, max_cpu_loras=2)
    ops, evicted, loaded = llm._lora.ops, [], []
    unload, load = ops.unload_lora, ops.load_lora

    def spy_unload(lora_id):
        assert lora_id not in llm.scheduler.lora_ids_running(), lora_id
        evicted.append(lora_id)
        unload(lora_id)

    def spy_load(lora_id, name, path):
        loaded.append(lora_id)
        load(lora_id, name, path)

    ops.unload_lora, ops.load_lora = spy_unload, spy_load
    assert run(llm) == want
    assert len(evicted) >= 4 and 1 not in evicted and 1 not in loaded, (evicted, loaded)


def test_a_runtime_load_evicts_the_least_recently_used(setup):
    model, adapters = setup
    llm = LLM(model, dtype="float32", num_kv_blocks=256, enable_lora=True,
              allow_runtime_lora_updating=True, max_cpu_loras=1)
    want = _generate(_llm(model, adapters, max_loras=1), _prompts(3), NAMES, 5)
    for name in NAMES:
        llm.load_lora(name, adapters[name])
        assert len(llm.runner.lora.adapters) == 1
    assert [a.name for a in llm.lora_adapters()] == list(NAMES)     # all three still served
    assert _generate(llm, _prompts(3), NAMES, 5) == want
    llm.unload_lora("a")
    assert _generate(llm, _prompts(2)[1:], ["b"], 5) == want[1:2]


def test_a_directory_gone_before_it_is_read_again(setup, tmp_path):
    """Served, evicted, then its directory deleted: the request that wants it ends (aborted),
    the adapter is no longer served (NOT_FOUND), the others run on."""
    model, adapters = setup
    gone = shutil.copytree(adapters["c"], tmp_path / "c")
    llm = _llm(model, {"a": adapters["a"], "c": str(gone)}, max_cpu_loras=1)
    assert sorted(llm.runner.lora.adapters) == [0]                 # 'a' only
    shutil.rmtree(gone)
    outs = llm.generate(_prompts(2), SamplingParams(),
                        StoppingParams(max_tokens=3, ignore_eos=True), lora_request=["c", "a"])
    assert outs[0].finish_reason == RequestStatus.FINISHED_ABORTED
    assert outs[1].finish_reason == RequestStatus.FINISHED_LENGTH
    with pytest.raises(ParamError, match=r"lora_request='c'"):
        llm.generate([[5, 6]], lora_request="c")
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("kw,message", [
    ({"max_cpu_loras": 0}, r"max_cpu_loras=0 is invalid: must be an integer in \[1, 1024\]"),
    ({"max_cpu_loras": 1025}, r"max_cpu_loras=1025 is invalid"),
    ({"max_cpu_loras": 1, "max_loras": 2},
     r"max_cpu_loras=1 is invalid: must be in \[max_loras=2, 1024\]")])
def test_bad_values_are_refused_naming_the_flag(setup, kw, message):
    model, adapters = setup
    with pytest.raises(ParamError, match=message):
        _llm(model, adapters, **kw)


def test_a_bad_adapter_the_cache_does_not_hold_refuses_the_start(setup, tmp_path):
    """Each adapter of --lora-modules is read at start, held or not (as without the flag)."""
    model, adapters = setup
    big = make_adapter(model, tmp_path / "big", r=32, seed=9)
    with pytest.raises(WorkerRefused, match=r"--lora-modules adapter 'big': .*r=32 is invalid: "
                                            r"must be in \[1, max_lora_rank=16\]"):
        _llm(model, {"a": adapters["a"], "big": big}, max_cpu_loras=1)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_evicted_adapters_request_is_served_under_a_storm(setup, async_scheduling):
    """--max-loras 1 --max-cpu-loras 1: 'a' runs, a request of 'c' (not loaded) waits, then
    each step a request of 'a' or 'b' arrives and every third step three of the newest are
    aborted (running or waiting). The request of 'c' is served (c read again, before every
    request that arrived after it), with c's tokens; at the end nothing leaks: no block, no
    slot past the limit, the workers hold what the LRU says."""
    from deltaserve.llm_requests import OfflineRequests

    model, adapters = setup
    want = _generate(_llm(model, adapters, max_loras=1), _prompts(3)[2:], ["c"], 4)[0]
    llm = _llm(model, adapters, max_loras=1, max_cpu_loras=1,
               async_scheduling=async_scheduling)
    held, engine = _held_spy(llm), llm.engine
    names = ["a", "c"] + ["a", "b"] * 40
    first = _prompts(3)
    prompts = [first[0], first[2]] + [[20 + i % 50, 9, 4] for i in range(len(names) - 2)]
    stops = [StoppingParams(max_tokens=n, ignore_eos=True) for n in [12, 4] + [3] * 80]
    calls = OfflineRequests(llm, prompts, SamplingParams(), stops, None, None,
                            lora_request=names)
    ids = calls.request_ids
    done, tokens = {}, {}
    engine.add_request(calls.request(0))
    engine.add_request(calls.request(1))
    for step in range(len(names) - 2):
        engine.add_request(calls.request(step + 2))
        if step % 3 == 2:
            for out in engine.abort([i for i in ids[max(2, step - 1):step + 3]
                                     if i not in done]):
                done[out.request_id] = out
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens[ids[1]] == want                     # c's request, with c's tokens
    assert done[ids[1]].finish_reason == RequestStatus.FINISHED_LENGTH
    aborted = [o for o in done.values() if o.finish_reason == RequestStatus.FINISHED_ABORTED]
    assert len(aborted) >= 20 and llm._lora.cache.num_evictions >= 3
    assert_no_leaked_blocks(llm)
    assert max(held) <= 1, held
    resident = llm._lora.cache.resident()
    assert sorted(s + 1 for s in llm.runner.lora.adapters) == sorted(resident)


def test_unloading_an_evicted_adapter_with_a_queued_request(setup):
    """'b' evicted ('a' loaded), a request of 'b' queued, then 'b' unloaded: the queued
    request still runs with b (read again from its path, as a queued request of an unloaded
    adapter finishes with it), then b's id is freed: not held by the LRU nor by the runner."""
    from deltaserve.llm_requests import OfflineRequests

    model, adapters = setup
    two = {n: adapters[n] for n in "ab"}
    want = _generate(_llm(model, two, max_loras=1), _prompts(2)[1:], ["b"], 4)[0]
    llm = _llm(model, two, max_loras=1, max_cpu_loras=1, allow_runtime_lora_updating=True)
    assert llm._lora.cache.resident() == [1]                          # 'a' only
    calls = OfflineRequests(llm, _prompts(2)[1:], SamplingParams(),
                            StoppingParams(max_tokens=4, ignore_eos=True), None, None,
                            lora_request=["b"])
    llm.engine.add_request(calls.request(0))
    llm.unload_lora("b")
    tokens = []
    while llm.engine.has_work():
        for out in llm.engine.step():
            tokens += out.new_token_ids
        llm._lora.sweep(llm.scheduler.lora_ids_in_use(), lambda: None)
    assert tokens == want
    assert 2 not in llm._lora.cache.resident() and 1 not in llm.runner.lora.adapters
    assert [a.name for a in llm.lora_adapters()] == ["a"]
    assert_no_leaked_blocks(llm)
