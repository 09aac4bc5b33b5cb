"""bench.host_overhead's gRPC lane end to end on CPU: real worker (simulated device) and
scheduler processes, a few tokens per request, alternating with a baseline checkout (this one
again): both trees' ratios and each process's CPU per step are printed and appended."""
from __future__ import annotations

import re

from bench import host_overhead
from tests.support.paths import REPO

NUMBER = r"([\d.]+)"


def test_grpc_only_lane_alternates_with_the_baseline_and_reports_cpu(tmp_path, capsys):
    results = tmp_path / "results.md"
    argv = ["--grpc-only", "--rounds", "1", "--output-len", "6", "--baseline-tree", str(REPO),
            "--results-file", str(results)]
    assert host_overhead.main(argv) == 0
    out = capsys.readouterr().out
    assert "simulated device 5.8 ms/step, in-process" not in out     # --grpc-only
    assert "host work per decode step" not in out
    for tree in ("this tree", f"baseline {REPO}"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"{tree}: ratio"))
        ratio = re.search(rf"ratio {NUMBER} / {NUMBER} / {NUMBER}", line)
        assert ratio and float(ratio.group(2)) > 0, line
        for proc in ("worker", "scheduler", "client"):
            cpu = re.search(rf"{proc} {NUMBER} / {NUMBER} / {NUMBER}", line)
            assert cpu and float(cpu.group(2)) > 0, (proc, line)
        per_message = re.search(rf"CPU us per message {NUMBER} / {NUMBER} / {NUMBER}", line)
        assert per_message and float(per_message.group(2)) > 0, line
        messages = re.search(rf"messages per step {NUMBER} / {NUMBER} / {NUMBER}", line)
        assert messages and 0 < float(messages.group(2)) <= 128, line
    assert re.search(rf"this tree / baseline \(median ratios\): {NUMBER}", out)
    assert "--grpc-only" in results.read_text()
