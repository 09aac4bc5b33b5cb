"""A second Ctrl-C in the middle of an offline step (the first waits for the step to end, the
second raises where it lands: llm_interrupt.py) leaves the LLM usable: the call raises
KeyboardInterrupt at once, nothing stays held once the runner thread ended its steps, and the
next generate on the same object answers the
greedy tokens of transformers. Real SIGINTs, on the sync, async and pipelined engines, landing
after the scheduler counted a step and before the runner took it, inside the model's forward,
and after the runner answered, before the scheduler took the answer. Before, every later
call failed ("step 2 arrived after step 0")."""
from __future__ import annotations

import signal
import threading

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.hf_reference import hf_greedy
from tests.integration.test_offline_nothing_held import MODES, assert_nothing_held

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
STOP = StoppingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen3")


@pytest.fixture(params=list(MODES))
def llm(request, model):
    with LLM(model, dtype="float32", num_kv_blocks=32, max_num_seqs=4,
             **MODES[request.param]) as llm:
        yield llm


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (the LLM defers Ctrl-C only under it)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _twice() -> None:
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGINT)


def _patch_scheduled(llm, calls):
    """After the scheduler counted the second step, before the runner took it."""
    target, name = llm.scheduler, "schedule"
    original = getattr(target, name)

    def patched(*args):
        out = original(*args)
        calls.append(1)
        if len(calls) == 2:
            _twice()
        return out
    return target, name, patched


def _patch_forward(llm, calls):
    """Inside the model's forward of the second step (on the runner thread when scheduling is
    async: Python then raises it in the main thread, waiting for the step); the simulated
    device of the pipelined runner has no forward: as it launches the step."""
    target, name = ((llm.runner, "launch_step") if llm.runner.pipelined
                    else (llm.runner.model, "forward"))
    original = getattr(target, name)

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            _twice()
        return original(*args, **kwargs)
    return target, name, patched


def _patch_updating(llm, calls):
    """After the runner answered the second step, before the scheduler took the answer."""
    target, name = llm.scheduler, "update_from_output"
    original = getattr(target, name)

    def patched(*args):
        calls.append(1)
        if len(calls) == 2:
            _twice()
        return original(*args)
    return target, name, patched


WHERE = {"scheduled": _patch_scheduled, "forward": _patch_forward, "updating": _patch_updating}


@pytest.mark.parametrize("where", list(WHERE))
def test_a_second_ctrl_c_mid_step_leaves_the_llm_usable(llm, model, default_sigint, where):
    reference = _run(llm)
    if not llm.runner.pipelined:           # the simulated device's tokens are not the model's
        assert reference == [list(hf_greedy(model, tuple(p), STOP.max_tokens).token_ids)
                             for p in PROMPTS]
    calls: list[int] = []
    target, name, patched = WHERE[where](llm, calls)
    setattr(target, name, patched)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(), STOP)
    finally:
        delattr(target, name)
    assert len(calls) >= 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert_nothing_held(llm)
    assert _run(llm) == reference
    assert_nothing_held(llm)


def _run(llm: LLM) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, SamplingParams(), STOP)]


def test_interrupted_while_starting_over_the_next_call_tries_again(llm, default_sigint):
    """A Ctrl-C while the LLM finishes starting over (at the next call, waiting for the old
    runner thread or dropping the runner's requests) fails that call only: the one after it
    starts over again and answers."""
    reference = _run(llm)
    calls: list[int] = []
    target, name, patched = _patch_scheduled(llm, calls)
    setattr(target, name, patched)
    llm.runner.reset = _interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(), STOP)
        delattr(target, name)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, SamplingParams(), STOP)
    finally:
        if name in vars(target):
            delattr(target, name)
        del llm.runner.reset
    assert _run(llm) == reference
    assert_nothing_held(llm)


@pytest.mark.parametrize("mode", ["async", "pipelined"])
def test_a_ctrl_c_in_a_step_that_does_not_end_returns_at_once(model, mode):
    """The second Ctrl-C is the way out of a step that does not end (llm_interrupt.py): it
    raised KeyboardInterrupt only once the runner thread's step ended (the start-over waited
    for it), so a hung step kept the caller hung. Here the caller's own SIGINT handler raises
    (once), as the second Ctrl-C does, while the runner thread's step waits for the test (a
    bounded wait: 60 s before the fix); afterwards the LLM answers as before."""
    with LLM(model, dtype="float32", num_kv_blocks=32, max_num_seqs=4, **MODES[mode]) as llm:
        reference = _run(llm)
        started_over, release, ended = threading.Event(), threading.Event(), threading.Event()
        start_over, raised = llm._start_over, []

        def noting_start_over():
            started_over.set()
            start_over()
        llm._start_over = noting_start_over
        target, name = ((llm.runner, "launch_step") if llm.runner.pipelined
                        else (llm.runner.model, "forward"))
        original, calls = getattr(target, name), []

        def hung(*args, **kwargs):             # on the runner thread
            calls.append(1)
            if len(calls) == 2:
                # Sent again while unanswered: a signal landing just before the main thread
                # blocks on a lock is seen only once it wakes (CPython); the handler raises once.
                while not started_over.wait(timeout=0.5):
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                release.wait(timeout=60)
                ended.set()
            return original(*args, **kwargs)

        def raise_once(_signum, _frame):
            if not raised:
                raised.append(1)
                raise KeyboardInterrupt
        before = signal.signal(signal.SIGINT, raise_once)
        setattr(target, name, hung)
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS, SamplingParams(), STOP)
            assert not ended.is_set(), "the Ctrl-C waited for the step to end"
        finally:
            release.set()
            signal.signal(signal.SIGINT, before)
            delattr(target, name)
            del llm._start_over
        assert _run(llm) == reference
        assert_nothing_held(llm)


def _interrupted() -> None:
    raise KeyboardInterrupt
