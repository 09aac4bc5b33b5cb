"""LLM.generate returns with nothing held for its requests: no KV block taken, and the model
runner caches none of them (no cached request state, no persistent-batch row), no step in
flight. Also after a call refused half way and after Ctrl-C; the next call then answers as
before. Sync, async scheduling, and the pipelined runner (the simulated device: step t+1
launched before step t finishes, as on CUDA).

Before, the runner heard of a call's finished requests only in the next call's first step: they
stayed cached (with their rows, grammar matchers, sampler state) while the LLM sat idle."""
from __future__ import annotations

import signal

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.admission import RequestRejected
from tests.support.engine_checks import assert_no_leaked_blocks

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
STOP = StoppingParams(max_tokens=5, ignore_eos=True)
MODES = {"sync": dict(async_scheduling=False), "async": dict(async_scheduling=True),
         "pipelined": dict(async_scheduling=True, simulated_device_ms=0.0)}


@pytest.fixture(scope="module", params=list(MODES))
def llm(request, tiny_models):
    return LLM(tiny_models("qwen3"), num_kv_blocks=32, max_num_seqs=4, **MODES[request.param])


def assert_nothing_held(llm: LLM) -> None:
    # After a call interrupted inside a step the runner drops its requests once its thread
    # ended the steps it had (LLM._start_over): at the next call, or here, waiting for it.
    llm._settle()
    assert_no_leaked_blocks(llm)
    runner = llm.runner
    assert runner.requests == {}, f"the runner still caches {len(runner.requests)} requests"
    assert runner.batch.num_reqs == 0
    assert llm.engine.core.num_steps_in_flight == 0 and not llm.engine.has_work()


def _run(llm: LLM) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(), STOP)]


def test_generate_returns_with_nothing_held(llm):
    first = _run(llm)
    assert [len(t) for t in first] == [5, 5, 5]
    assert_nothing_held(llm)
    assert _run(llm) == first
    assert_nothing_held(llm)


def test_a_call_refused_half_way_holds_nothing(llm):
    """One prompt too long beside good ones."""
    reference = _run(llm)
    too_long = [5] * llm.model_info.max_model_len
    with pytest.raises(RequestRejected):
        llm.generate(PROMPTS + [too_long], SamplingParams(), STOP)
    assert_nothing_held(llm)
    assert _run(llm) == reference


@pytest.mark.parametrize("where", ["between steps", "collecting a step"])
def test_ctrl_c_holds_nothing_and_the_llm_goes_on(llm, where):
    """Ctrl-C after the engine's second step, or (async) while it waits for a step's reply,
    whose reply is then lost: the requests are aborted and the runner drops them."""
    reference = _run(llm)
    core = llm.engine.core
    target = core if where == "between steps" else core.executor
    name = "step" if where == "between steps" else ("collect" if core.async_scheduling
                                                    else "execute")
    original, calls = getattr(target, name), []

    def interrupted(*args):
        out = original(*args)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return out

    setattr(target, name, interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(), STOP)
    finally:
        delattr(target, name)
    assert_nothing_held(llm)
    assert _run(llm) == reference
    assert_nothing_held(llm)


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test (the LLM defers Ctrl-C only under it): in the
    whole suite an earlier test's event loop can leave its own handler behind (asyncio's no-op
    one); in CI all six Ctrl-C cases then saw no KeyboardInterrupt."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_inside_a_step_is_taken_after_it(llm, default_sigint):
    """A real SIGINT right after the scheduler counted a step, before the runner took it: the
    step goes on, then the call stops. Before, the KeyboardInterrupt left the two disagreeing
    and every later call of the LLM failed ("step 9 arrived after step 7")."""
    reference = _run(llm)
    scheduler = llm.scheduler
    schedule, calls = scheduler.schedule, []

    def interrupted_schedule():
        out = schedule()
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return out

    scheduler.schedule = interrupted_schedule
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(), STOP)
    finally:
        del scheduler.schedule
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert_nothing_held(llm)
    assert _run(llm) == reference


def test_a_second_ctrl_c_raises_at_once(llm, default_sigint):
    """For a step that never ends: the first Ctrl-C waits for it, the second does not."""
    scheduler = llm.scheduler
    schedule, after = scheduler.schedule, []

    def twice_interrupted_schedule():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        after.append(1)                   # not reached
        return schedule()

    scheduler.schedule = twice_interrupted_schedule
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(), STOP)
    finally:
        del scheduler.schedule
    assert after == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert_nothing_held(llm)
