"""The simulated device: steps run one at a time in launch order, read-back waits without CPU,
and a runner on it does the host work and returns the device's tokens."""
from __future__ import annotations

import numpy as np
import pytest

from worker_service.runner.simulated_device import SimulatedDevice


class FakeClock:
    """Injected time: sleep() advances it, so nothing here waits for real."""

    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_steps_queue_behind_each_other_and_wait_sleeps_until_done():
    clock = FakeClock()
    dev = SimulatedDevice(0.005, vocab_size=512, clock=clock, sleep=clock.sleep)
    first = dev.sample(np.array([10, 20]))
    clock.now += 0.001                       # the host launches the next step 1 ms later
    second = dev.sample(np.array([11]))
    assert second.done_at == pytest.approx(first.done_at + 0.005)
    out = first.wait()
    assert clock.slept == [pytest.approx(0.004)]
    assert out.token_ids.tolist() == [(10 * 7 + 3) % 512, (20 * 7 + 3) % 512]
    assert out.logprobs.tolist() == [0.0, 0.0]
    second.wait()
    assert clock.now == pytest.approx(first.done_at + 0.005)
    assert dev.busy_s == pytest.approx(0.010)


def test_a_late_launch_starts_when_it_is_launched():
    clock = FakeClock()
    dev = SimulatedDevice(0.002, vocab_size=512, clock=clock, sleep=clock.sleep)
    dev.sample(np.array([1])).wait()
    clock.now += 1.0                          # the host was slow: the device sat idle
    late = dev.sample(np.array([2]))
    assert late.done_at == pytest.approx(clock.now + 0.002)
    clock.now += 0.010                        # read long after it is done: no sleep
    late.wait()
    assert len(clock.slept) == 1


def test_negative_device_time_is_refused():
    with pytest.raises(ValueError, match="simulated_device_ms"):
        SimulatedDevice(-0.001, vocab_size=512)


def test_engine_on_the_simulated_device_runs_the_host_work(tiny_models):
    """The in-process engine with async scheduling pipelines on it (step t+1 launched before
    step t is finished) and every request gets its max_tokens of the device's tokens."""
    from deltaserve.llm import LLM
    from engine_common.request.params import SamplingParams, StoppingParams

    llm = LLM(tiny_models("qwen3"), dtype="float32", num_kv_blocks=64, max_num_seqs=4,
              async_scheduling=True, simulated_device_ms=0.0)
    assert llm.runner.pipelined
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    outs = llm.generate(prompts, SamplingParams(), StoppingParams(max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        positions = np.arange(len(prompt), len(prompt) + 6)
        assert out.token_ids == ((positions * 7 + 3) % llm.model_info.vocab_size).tolist()
    assert llm.scheduler.kv.num_free_blocks == llm.scheduler.num_total_blocks
