"""InProcessExecutor's async hand-off: collect(step t) returns only once step t+1 has reached its
sampler (or ended), so the engine thread's Python runs while the runner is in the GIL-free LM
head instead of beside the Python that prepares step t+1. Checked by the order of events on a
runner stand-in whose steps are gated by events (no timing)."""
from __future__ import annotations

import threading

import pytest

from deltaserve.llm_executor import InProcessExecutor
from engine_common.wire.codec import decode_runner_output
from engine_common.wire.diff import RunnerOutput

WAIT_S = 60.0       # only a hang hits this


class GatedRunner:
    """execute(payload) -> RunnerOutput(step=int(payload)); each step calls on_sampling after
    its gate `ready[step]` opens, then finishes once `finish[step]` opens."""

    pipelined = False     # a CPU runner: steps run one after another

    def __init__(self, steps: int, sample: bool = True) -> None:
        self.on_sampling = None
        self.sample = sample
        self.ready = [threading.Event() for _ in range(steps)]
        self.finish = [threading.Event() for _ in range(steps)]
        self.log: list[str] = []

    def execute(self, payload: bytes) -> RunnerOutput:
        step = int(payload)
        assert self.ready[step].wait(WAIT_S)
        if self.sample and self.on_sampling is not None:
            self.log.append(f"sampling {step}")
            self.on_sampling()
        assert self.finish[step].wait(WAIT_S)
        self.log.append(f"done {step}")
        if step == 99:
            raise RuntimeError("step 99 fails")
        return RunnerOutput(step=step)


def _collect_in_thread(executor, ticket, log):
    out = {}

    def run():
        try:
            out["reply"] = decode_runner_output(executor.collect(ticket))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e
        log.append("collected")
    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_collect_waits_for_the_next_step_to_reach_its_sampler():
    runner = GatedRunner(3)
    executor = InProcessExecutor(runner)
    first, second = executor.submit(b"0"), executor.submit(b"1")
    runner.ready[0].set()
    runner.finish[0].set()
    thread, out = _collect_in_thread(executor, first, runner.log)
    assert first.result(WAIT_S).__class__ is bytes          # step 0 is done ...
    runner.ready[1].set()                                   # ... step 1 reaches its sampler
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert out["reply"].step == 0
    assert runner.log.index("done 0") < runner.log.index("sampling 1") < \
        runner.log.index("collected")
    runner.finish[1].set()
    assert decode_runner_output(executor.collect(second)).step == 1   # none queued: at once
    assert executor._sampling == type(executor._sampling)()


def test_collect_returns_when_the_next_step_ends_without_sampling():
    runner = GatedRunner(3, sample=False)           # e.g. a prefill chunk that samples nothing
    executor = InProcessExecutor(runner)
    first, second = executor.submit(b"0"), executor.submit(b"1")
    for gate in (runner.ready[0], runner.finish[0], runner.ready[1]):
        gate.set()
    thread, out = _collect_in_thread(executor, first, runner.log)
    runner.finish[1].set()
    thread.join(WAIT_S)
    assert not thread.is_alive() and out["reply"].step == 0
    assert runner.log.index("done 1") < runner.log.index("collected")
    assert decode_runner_output(executor.collect(second)).step == 1


def test_a_failed_step_still_releases_the_collect_before_it():
    runner = GatedRunner(100)
    executor = InProcessExecutor(runner)
    first, failing = executor.submit(b"0"), executor.submit(b"99")
    runner.sample = False
    for gate in (runner.ready[0], runner.finish[0], runner.ready[99], runner.finish[99]):
        gate.set()
    assert decode_runner_output(executor.collect(first)).step == 0
    with pytest.raises(RuntimeError, match="step 99 fails"):
        executor.collect(failing)
    assert runner.on_sampling is None


class PipelinedRunner:
    """The pipelined runner interface: decode / needs_host_tokens / launch_step / finish_step;
    logs every call. A payload b"h" marks a step that needs the previous ids on the host."""

    pipelined = True

    def __init__(self) -> None:
        self.log: list[str] = []

    def decode(self, payload: bytes):
        return payload

    def needs_host_tokens(self, diff) -> bool:
        return diff.endswith(b"h")

    def launch_step(self, diff, feed):
        step = int(diff.rstrip(b"h"))
        self.log.append(f"launch {step} feed={None if feed is None else feed}")
        return step

    def finish_step(self, pending):
        self.log.append(f"finish {pending}")
        return RunnerOutput(step=pending)


def test_a_pipelined_runner_launches_the_next_step_before_finishing_this_one():
    runner = PipelinedRunner()
    executor = InProcessExecutor(runner)
    first, second = executor.submit(b"0"), executor.submit(b"1")
    executor.wait_launched(second)
    assert decode_runner_output(executor.collect(first)).step == 0
    third = executor.submit(b"2h")                   # needs step 1's ids on the host
    assert decode_runner_output(executor.collect(second)).step == 1
    assert decode_runner_output(executor.collect(third)).step == 2   # the last: finished alone
    assert runner.log == ["launch 0 feed=None", "launch 1 feed=0", "finish 0",
                          "finish 1", "launch 2 feed=None", "finish 2"]
