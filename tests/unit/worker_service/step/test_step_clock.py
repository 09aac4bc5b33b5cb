"""StepClock: each phase's wall time and the runner thread's CPU time over the same span."""
from __future__ import annotations

from worker_service.step.step_clock import StepClock


class Ticks:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phases_hold_wall_and_thread_cpu_time_per_span():
    wall, cpu = Ticks(), Ticks()
    clock = StepClock(wall=wall, cpu=cpu)
    clock.start()
    wall.now, cpu.now = 3.0, 2.5            # busy: CPU close to wall
    clock.mark("input_prep")
    wall.now, cpu.now = 13.0, 3.0           # blocked: 10 s of wall, 0.5 s of CPU
    clock.mark("forward")
    wall.now, cpu.now = 14.0, 3.5
    clock.mark("forward")                   # a phase marked twice adds up
    assert clock.phases == {"input_prep": 3.0, "forward": 11.0}
    assert clock.cpu_phases == {"input_prep": 2.5, "forward": 1.0}


def test_start_forgets_the_last_step():
    wall, cpu = Ticks(), Ticks()
    clock = StepClock(wall=wall, cpu=cpu)
    clock.start()
    wall.now = cpu.now = 1.0
    clock.mark("sampling")
    clock.start()
    wall.now, cpu.now = 4.0, 2.0
    clock.mark("readback")
    assert clock.phases == {"readback": 3.0}
    assert clock.cpu_phases == {"readback": 1.0}


def test_without_a_cpu_clock_only_wall_time_is_kept():
    wall = Ticks()
    clock = StepClock(wall=wall)
    clock.start()
    wall.now = 2.0
    clock.mark("forward")
    assert clock.phases == {"forward": 2.0} and clock.cpu_phases == {}
