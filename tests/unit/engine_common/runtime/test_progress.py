"""engine_common/runtime/progress.py: the lines a first run prints during its long steps, driven by an
injected clock and wait (no sleeps): quarters with the elapsed time, a heartbeat while a step
that cannot count runs, its time (or failure) at the end, and the command form the Makefile
uses, run for real."""
from __future__ import annotations

import sys
import threading

import pytest

from engine_common.runtime.progress import Progress, heartbeat, main, run_with_heartbeat


class FakeClock:
    """Returns the given times in order, one per call."""

    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_progress_prints_each_quarter_with_the_elapsed_time():
    lines: list[str] = []
    progress = Progress("loading weights of M", 8, "tensors", emit=lines.append,
                        clock=FakeClock(100.0, 100.5, 101.0, 101.25, 102.0))
    for _ in range(8):
        progress.advance()
    assert lines == ["loading weights of M: 25% (2/8 tensors, 0.5 s)",
                     "loading weights of M: 50% (4/8 tensors, 1.0 s)",
                     "loading weights of M: 75% (6/8 tensors, 1.2 s)",
                     "loading weights of M: 100% (8/8 tensors, 2.0 s)"]


def test_progress_of_fewer_units_than_steps_prints_once_per_unit():
    lines: list[str] = []
    progress = Progress("capturing", 3, "batch sizes", emit=lines.append,
                        clock=FakeClock(0.0, 1.0, 2.0, 3.0))
    for _ in range(3):
        progress.advance()
    assert [line.split(": ")[1].split("%")[0] for line in lines] == ["33", "66", "100"]


def test_progress_in_one_jump_prints_one_line():
    lines: list[str] = []
    Progress("x", 10, "u", emit=lines.append, clock=FakeClock(0.0, 4.0)).advance(10)
    assert lines == ["x: 100% (10/10 u, 4.0 s)"]


def test_progress_of_nothing_prints_nothing():
    lines: list[str] = []
    Progress("x", 0, "u", emit=lines.append, clock=FakeClock(0.0)).advance()
    assert lines == []


def test_progress_refuses_zero_steps():
    with pytest.raises(ValueError, match="steps=0 is invalid: must be >= 1"):
        Progress("x", 4, "u", steps=0)


def test_heartbeat_beats_while_the_step_runs_then_says_how_long_it_took():
    lines: list[str] = []
    beaten = threading.Event()
    periods = iter([False, False])          # two periods pass without the step ending

    def emit(line: str) -> None:
        lines.append(line)
        if len(lines) == 3:
            beaten.set()

    def wait(stop: threading.Event, seconds: float) -> bool:
        assert seconds == 10.0
        return next(periods, None) is None and stop.wait()

    with heartbeat("building CPU kernels", emit=emit, clock=FakeClock(0.0, 10.2, 20.4, 63.25),
                   wait=wait):
        assert beaten.wait(60)
    assert lines == ["building CPU kernels...", "building CPU kernels: 10 s so far",
                     "building CPU kernels: 20 s so far", "building CPU kernels: done in 63.2 s"]


def test_heartbeat_of_a_quick_step_prints_its_start_and_end_only():
    lines: list[str] = []
    with heartbeat("warm-up", emit=lines.append, clock=FakeClock(5.0, 5.5)):
        pass
    assert lines == ["warm-up...", "warm-up: done in 0.5 s"]


def test_heartbeat_says_the_step_failed_and_lets_the_error_through():
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        with heartbeat("warm-up", emit=lines.append, clock=FakeClock(0.0, 2.0)):
            raise RuntimeError("boom")
    assert lines == ["warm-up...", "warm-up: failed in 2.0 s"]


def test_a_command_runs_under_the_heartbeat_with_its_exit_code(capfd):
    lines: list[str] = []
    code = run_with_heartbeat("step", [sys.executable, "-c", "print('child says hi')"],
                              emit=lines.append)
    assert code == 0
    assert "child says hi" in capfd.readouterr().out
    assert lines[0] == "step..." and lines[-1].startswith("step: done in ")


def test_a_failing_command_says_so_and_keeps_its_exit_code():
    lines: list[str] = []
    code = run_with_heartbeat("step", [sys.executable, "-c", "raise SystemExit(3)"],
                              emit=lines.append)
    assert code == 3
    assert lines[-2].startswith("step: failed in ")
    assert lines[-1].endswith("exited with code 3")


def test_a_command_that_cannot_start_is_127():
    lines: list[str] = []
    assert run_with_heartbeat("step", ["/nonexistent/deltaserve-no-such-command"],
                              emit=lines.append) == 127
    assert "cannot run '/nonexistent/deltaserve-no-such-command'" in lines[-1]


def test_the_command_form_needs_a_label_and_a_command(capsys):
    assert main(["label", "--"]) == 2
    assert main(["label", sys.executable]) == 2
    assert "usage: python -m engine_common.runtime.progress LABEL -- CMD" in capsys.readouterr().err
    assert main(["label", "--", sys.executable, "-c", "pass"]) == 0
