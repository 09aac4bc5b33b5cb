"""A stand-in device for measuring the host's share of a step: no model, a timed wait.

With RunnerConfig.simulated_device_ms set, the runner does all of a step's host work for real
(diff, batch, inputs, staging, sampling columns) and then, instead of the forward pass and the
sampler, "launches" the step on this device: it is done `step_s` after it was launched, or after
the step before it is done, whichever is later (a device runs one step at a time, in launch
order). Reading the tokens back sleeps until then, holding no GIL and burning no CPU, like a host
waiting on a GPU event. So a benchmark shows directly whether the host's work per step hides
behind the device's (bench/host_overhead.py). It is an instrument, not a test double: its tokens
are a fixed function of the position, and its logprobs are 0.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from worker_service.sample.token_readback import SampledTokens


class SimulatedTokens:
    """One step's tokens on the simulated device: wait() sleeps until the step is done."""

    def __init__(self, token_ids: np.ndarray, done_at: float, device: "SimulatedDevice"):
        self.token_ids, self.done_at, self.device = token_ids, done_at, device

    def wait_device(self) -> None:
        delay = self.done_at - self.device.clock()
        if delay > 0:
            self.device.sleep(delay)

    def wait(self) -> SampledTokens:
        self.wait_device()
        return SampledTokens(self.token_ids, np.zeros(len(self.token_ids), dtype=np.float32))


class SimulatedDevice:
    """Steps of `step_s` seconds each, run one at a time in launch order."""

    def __init__(self, step_s: float, vocab_size: int,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        if not step_s >= 0:
            raise ValueError(f"simulated_device_ms={step_s * 1e3} is invalid: must be >= 0")
        self.step_s, self.vocab_size = step_s, vocab_size
        self.clock, self.sleep = clock, sleep
        self.busy_until = 0.0
        self.busy_s = 0.0           # device time of every step launched so far

    def sample(self, positions: np.ndarray) -> SimulatedTokens:
        """Launch a step that samples one token per entry of `positions` (each request's
        token index: the ids are (7 * position + 3) mod the vocabulary)."""
        done_at = max(self.clock(), self.busy_until) + self.step_s
        self.busy_until = done_at
        self.busy_s += self.step_s
        ids = (positions.astype(np.int64) * 7 + 3) % self.vocab_size
        return SimulatedTokens(ids, done_at, self)
