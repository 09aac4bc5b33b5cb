"""bench.step_profile on CPU: the recorded window's host phases, wall and thread CPU time."""
from __future__ import annotations

import re

from bench import step_profile

ARGS = ["--preset", "tiny", "--device", "cpu", "--num-seqs", "8", "--min-len", "4",
        "--max-len", "12", "--skip", "0", "--steps", "4"]


def _phase(name: str, out: str) -> tuple[float, float, float]:
    match = re.search(rf"^  {re.escape(name)}\s+([\d.]+) /\s+([\d.]+) /\s+([\d.]+)$", out, re.M)
    assert match, f"{name!r} not in output:\n{out}"
    return tuple(float(g) for g in match.groups())


def test_host_only_prints_each_runner_phase_in_wall_and_thread_cpu_time(capsys, bench_presets):
    assert step_profile.main(ARGS + ["--host-only", "--cache-dir", str(bench_presets)]) == 0
    out = capsys.readouterr().out
    assert "host phases over 4 recorded steps" in out
    for phase in ("input_prep", "forward", "sampling"):
        wall, cpu = _phase(f"runner: {phase}", out), _phase(f"runner: {phase}, thread cpu", out)
        assert max(wall) > 0 and max(cpu) > 0
    # --host-only records no trace: no device or kernel report follows the phases.
    assert "device" not in out.split("host phases", 1)[1]
