"""LoRA adapters loaded and unloaded at run time in the in-process LLM (docs/lora.md, "Loading
at run time"): a loaded adapter's greedy tokens equal transformers + peft's, fp32; an unloaded
one is NOT_FOUND (AdapterNotFound); the same name loaded again from another directory gives
that directory's tokens and never hits the prefix-cache blocks of the one before, though it
reuses its id; refused directories leave nothing loaded."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.configuration.lora import AdapterExists, AdapterNotFound, AdapterRefused
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from scheduler_service.errors import LoRAUpdatesOff
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy
from tests.support.lora_adapters import bad_adapters, make_adapter, peft_greedy

MAX_NEW = 10
MAX_RANK = 8
# 40 tokens: two full 16-token blocks the prefix cache can hit.
PROMPT = [11, 40, 7, 93, 5, 120, 64, 3, 77, 18, 25, 60, 31, 99, 140, 12, 9, 44, 81, 6,
          73, 150, 2, 58, 36, 101, 17, 88, 49, 130, 21, 67, 14, 110, 39, 95, 8, 52, 160, 27]


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    model = tiny_models("llama")
    root = tmp_path_factory.mktemp("lora-runtime")
    sql = make_adapter(model, root / "sql", r=8, alpha=32, seed=1)
    chat = make_adapter(model, root / "chat", r=4, alpha=8, seed=2, use_rslora=True,
                        targets=("q_proj", "v_proj", "down_proj"))
    return model, sql, chat, root


def _llm(model: str, **kw) -> LLM:
    return LLM(model, dtype="float32", num_kv_blocks=256, enable_lora=True,
               allow_runtime_lora_updating=True, max_lora_rank=MAX_RANK, max_loras=2, **kw)


def _run(llm: LLM, name: str | None):
    out = llm.generate([PROMPT], SamplingParams(),
                       StoppingParams(max_tokens=MAX_NEW, ignore_eos=True), lora_request=name)[0]
    assert_no_leaked_blocks(llm)
    return out


def _assert_peft(model: str, adapter_dir: str | None, out) -> None:
    near_ties = []
    failure = compare_greedy(str(adapter_dir), out.token_ids,
                             peft_greedy(model, adapter_dir, tuple(PROMPT), MAX_NEW), near_ties)
    assert_greedy_agrees([failure] if failure else [], near_ties)


def test_load_unload_reload(setup):
    model, sql, chat, _ = setup
    llm = _llm(model)
    _assert_peft(model, None, _run(llm, None))
    assert llm.load_lora("sql", sql) == 1
    first = _run(llm, "sql")
    _assert_peft(model, sql, first)
    assert _run(llm, "sql").num_cached_tokens == 32      # one adapter: its blocks are shared
    with pytest.raises(AdapterExists, match=r"lora_name='sql' is invalid: must be a name no "
                                            r"served adapter has"):
        llm.load_lora("sql", chat)
    llm.unload_lora("sql")
    assert llm.runner.lora.adapters == {}               # nothing ran with it: freed at once
    with pytest.raises(AdapterNotFound, match=r"lora_request='sql' is invalid: must be a "
                                              r"served LoRA adapter"):
        _run(llm, "sql")
    with pytest.raises(AdapterNotFound, match=r"lora_name='sql' is invalid"):
        llm.unload_lora("sql")
    # The same name and id again, other weights: its tokens, and no block of the old adapter.
    assert llm.load_lora("sql", chat) == 1
    again = _run(llm, "sql")
    assert again.num_cached_tokens == 0
    _assert_peft(model, chat, again)
    assert again.token_ids != first.token_ids


def test_runtime_adapters_beside_static_ones(setup):
    """--lora-modules' adapters keep ids 1..n; a runtime load takes the next free id, and an
    unloaded static adapter's id is reused; mixed batches still match peft."""
    model, sql, chat, _ = setup
    llm = _llm(model, lora_modules=f"sql={sql}")
    # the runner holds what the server's workers would: max(--max-loras 2 + 1, 1 adapter)
    assert llm.runner.config.max_cpu_loras == llm.runner.lora.capacity == 3
    assert llm.load_lora("chat", chat) == 2
    llm.unload_lora("sql")
    assert llm.load_lora("sql2", sql) == 1
    assert [(a.name, a.lora_id, a.static) for a in llm.lora_adapters()] == [
        ("sql2", 1, False), ("chat", 2, False)]
    names = ["chat", None, "sql2", "chat"]
    outs = llm.generate([PROMPT] * 4, SamplingParams(),
                        StoppingParams(max_tokens=MAX_NEW, ignore_eos=True), lora_request=names)
    dirs = {"chat": chat, "sql2": sql, None: None}
    near_ties, failures = [], []
    for name, out in zip(names, outs):
        ref = peft_greedy(model, dirs[name], tuple(PROMPT), MAX_NEW)
        failure = compare_greedy(str(name), out.token_ids, ref, near_ties)
        failures += [failure] if failure else []
    assert_greedy_agrees(failures, near_ties)


def test_refused_directories_leave_nothing_loaded(setup, tmp_path):
    model, sql, _, _ = setup
    llm = _llm(model)
    for case, (path, reason) in bad_adapters(model, tmp_path, MAX_RANK).items():
        with pytest.raises(AdapterRefused) as err:
            llm.load_lora("bad", path)
        assert f"lora_path={path!r} is invalid" in str(err.value), case
        assert err.match(reason), case
        assert llm.lora_adapters() == [] and llm.runner.lora.adapters == {}, case
    assert llm.load_lora("sql", sql) == 1                # the refusals took no id
    _assert_peft(model, sql, _run(llm, "sql"))


def test_bad_names_and_the_flag(setup):
    model, sql, _, _ = setup
    llm = _llm(model)
    for name in ("", "two words", "x" * 257):
        with pytest.raises(ParamError, match=r"lora_name=.* is invalid: must be 1 to 256 "
                                             r"printable characters without whitespace"):
            llm.load_lora(name, sql)
    with pytest.raises(ParamError, match=r"lora_path='' is invalid"):
        llm.load_lora("sql", "")
    off = LLM(model, dtype="float32", num_kv_blocks=32, enable_lora=True)
    with pytest.raises(LoRAUpdatesOff, match="--allow-runtime-lora-updating"):
        off.load_lora("sql", sql)
    with pytest.raises(LoRAUpdatesOff, match="UnloadLoraAdapter: runtime LoRA updating is off"):
        off.unload_lora("sql")
    with pytest.raises(ParamError, match=r"enable_lora=False is invalid: must be true when "
                                         r"allow_runtime_lora_updating is set"):
        LLM(model, dtype="float32", num_kv_blocks=32, allow_runtime_lora_updating=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_unload_while_running_drains(setup, async_scheduling):
    """Step by step: a request running when its adapter is unloaded finishes with it (its slot
    stays on the runner, draining, and no load takes its id), a request resolved before the
    unload but queued after is refused, and the slot is freed once the request is done. With
    two steps in flight the unload first collects them (the server's drain)."""
    from scheduler_service.core.request import Request

    model, sql, chat, _ = setup
    llm = _llm(model, async_scheduling=async_scheduling)
    core = llm.engine.core
    llm.load_lora("sql", sql)
    registry = llm._lora.registry
    lora_id, generation = registry.resolve("sql")

    def request(rid: str) -> Request:
        return Request(rid, list(PROMPT), SamplingParams(),
                       StoppingParams(max_tokens=MAX_NEW, ignore_eos=True),
                       llm.model_info.eos_token_ids, lora_id=lora_id,
                       lora_generation=generation)

    running = request("running")
    llm.engine.add_request(running)
    llm.engine.step()                                    # the prompt: it runs now
    llm.engine.step()
    assert core.num_steps_in_flight == (2 if async_scheduling else 0)
    llm.unload_lora("sql")                              # nothing to free yet: no drain
    assert registry.draining() == {lora_id} and llm.runner.lora.holds(lora_id)
    with pytest.raises(AdapterNotFound, match=r"lora_name='id 1' is invalid: must be a served "
                                              r"LoRA adapter \(it was unloaded meanwhile\)"):
        llm.engine.add_request(request("late"))
    drain = lambda: llm.engine._outputs(core.drain_in_flight())      # noqa: E731
    assert llm._lora.load(llm._in_use(), drain, "chat", chat).lora_id == 2   # 1 is in use
    assert core.num_steps_in_flight == 0                 # loaded between steps
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert running.output_token_ids == list(
        peft_greedy(model, sql, tuple(PROMPT), MAX_NEW).token_ids)
    assert llm.runner.lora.holds(lora_id)               # freed at the next sweep: now
    llm._lora.sweep(llm._in_use(), lambda: None)
    assert not llm.runner.lora.holds(lora_id) and registry.draining() == set()
    assert llm.load_lora("sql", sql) == 1
