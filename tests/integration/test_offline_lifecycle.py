"""The offline LLM's life: close() (or leaving a `with` block) ends its runner thread and lets
the model and the KV cache go; dropping the last reference ends the thread too; calls from two
threads at once run one after the other with the answers each would get alone.

Before: no close(); on a pipelined runner (CUDA, the simulated device) the runner thread held
the runner, with the model and its KV cache, until the process ended, whatever the user
dropped; two threads' calls stepped the same engine at once."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
STOP = StoppingParams(max_tokens=4, ignore_eos=True)
MODES = {"sync": dict(async_scheduling=False), "async": dict(async_scheduling=True),
         "pipelined": dict(async_scheduling=True, simulated_device_ms=0.0)}
JOIN_S = 120.0          # only a hang reaches it


def _llm(tiny_models, mode: str) -> LLM:
    return LLM(tiny_models("qwen3"), num_kv_blocks=32, max_num_seqs=4, **MODES[mode])


def _run(llm: LLM) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(), STOP)]


def _run_first(llm: LLM) -> tuple[list[list[int]], list[threading.Thread]]:
    """The first call's tokens, and the runner threads it started."""
    before = set(threading.enumerate())
    tokens = _run(llm)
    return tokens, [t for t in threading.enumerate()
                    if t not in before and t.name.startswith("runner")]


@pytest.mark.parametrize("mode", list(MODES))
def test_close_ends_the_runner_thread_and_lets_the_model_go(tiny_models, mode):
    with _llm(tiny_models, mode) as llm:
        tokens, threads = _run_first(llm)
        assert [len(t) for t in tokens] == [4, 4]
        assert len(threads) == (mode != "sync")
        model, kv = weakref.ref(llm.runner.model), weakref.ref(llm.runner.kv_caches[0])
    gc.collect()
    assert not any(t.is_alive() for t in threads)
    assert model() is None and kv() is None, "the model or the KV cache outlived close()"
    with pytest.raises(RuntimeError, match=r"LLM.generate\(\): this LLM is closed"):
        _run(llm)
    llm.close()                                   # again: nothing to do


def test_dropping_the_llm_ends_its_pipelined_runner_thread(tiny_models):
    llm = _llm(tiny_models, "pipelined")
    (thread,) = _run_first(llm)[1]
    model = weakref.ref(llm.runner.model)
    del llm
    gc.collect()
    thread.join(JOIN_S)
    assert not thread.is_alive(), "the runner thread outlived its LLM"
    gc.collect()
    assert model() is None, "the runner thread kept the model"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_threads_at_once_get_what_each_would_alone(tiny_models, mode):
    """The second thread calls while the first is between its first and second step."""
    llm = _llm(tiny_models, mode)
    others = [[12, 13, 14], [15, 16]]
    alone = (_run(llm), [c.token_ids for c in llm.generate(others, SamplingParams(), STOP)])
    step, got, errors = llm.engine.step, {}, []

    def second():
        try:
            got["second"] = [c.token_ids for c in llm.generate(others, SamplingParams(), STOP)]
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    thread = threading.Thread(target=second)

    def first_step_starts_the_second_thread():
        if not thread.is_alive() and "second" not in got and not errors:
            thread.start()
        return step()

    llm.engine.step = first_step_starts_the_second_thread
    try:
        got["first"] = _run(llm)
        thread.join(JOIN_S)
    finally:
        del llm.engine.step
    assert not errors and (got["first"], got.get("second")) == alone


def test_a_call_from_inside_a_running_call_is_refused(tiny_models):
    """On the running call's own thread it could only wait for itself."""
    llm = _llm(tiny_models, "sync")
    reference, step, inner = _run(llm), llm.engine.step, []

    def step_calling_generate():
        if not inner:
            with pytest.raises(RuntimeError, match="inside a running LLM call"):
                llm.generate(PROMPTS, SamplingParams(), STOP)
            inner.append(1)
        return step()

    llm.engine.step = step_calling_generate
    try:
        assert _run(llm) == reference and inner == [1]
    finally:
        del llm.engine.step
