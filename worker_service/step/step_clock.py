"""Host wall time of one runner step, split into phases, for the worker's metrics.

    input_prep   check and apply the diff, build and stage the inputs and the sampling metadata
    forward      the model (eager or a captured graph), up to the sampled rows' logits
    sampling     the sampler, after the batch's token counts advance and (structured output)
                 the wait for the grammar masks computed beside the forward
    readback     the step's one host sync: waiting for the sampled ids to reach the host

Outside every phase: decoding the diff's payload (before the clock starts), writing the sampled
ids into the batch and building the reply (after readback), and encoding the reply.

Times are time.perf_counter() differences taken on the host with no extra synchronization. On
CPU each phase is its compute time. On CUDA forward and sampling are only the host's launch time:
the device time they queued surfaces in readback, where the host waits for it. `cpu_phases`
holds the runner thread's CPU time over the same spans when the clock is given one
(`StepClock(cpu=time.thread_time)`, as bench/step_profile.py does): a phase whose wall time is
well above its CPU time was blocked (the GIL, a full launch queue, a synchronizing allocation),
not busy. Off by default: time.thread_time is a system call (0.8 us each on the AMD EPYC VMs,
against 0.06 us for perf_counter), five a step, and only the profile reads it.
"""
from __future__ import annotations

import time

PHASES = ("input_prep", "forward", "sampling", "readback")


class StepClock:
    """`start()` at the step's beginning, `mark(phase)` at the end of each phase; `phases` holds
    the last step's seconds per phase (phases a step skipped are absent)."""

    def __init__(self, wall=time.perf_counter, cpu=None):
        self._wall, self._cpu = wall, cpu
        self.phases: dict[str, float] = {}
        self.cpu_phases: dict[str, float] = {}
        self._last = self._last_cpu = 0.0

    def start(self) -> None:
        self.phases, self.cpu_phases = {}, {}
        self._last = self._wall()
        if self._cpu is not None:
            self._last_cpu = self._cpu()

    def mark(self, phase: str) -> None:
        now = self._wall()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now
        if self._cpu is not None:
            cpu = self._cpu()
            self.cpu_phases[phase] = self.cpu_phases.get(phase, 0.0) + cpu - self._last_cpu
            self._last_cpu = cpu
