"""bench.prefill_host end to end on CPU: fresh child processes on a 0 ms simulated device, sync
and async lanes, alternating with a baseline checkout (this one again); ms per prefill step and
per new request for both trees, printed and appended."""
from __future__ import annotations

import re

from bench import prefill_host
from bench.isa import describe_cpu
from tests.support.paths import REPO

NUMBER = r"([\d.]+)"


def test_both_lanes_report_each_tree_per_prefill_step_and_per_request(tmp_path, capsys):
    results = tmp_path / "results.md"
    argv = ["--num-seqs", "12", "--max-tokens", "2", "--rounds", "1", "--baseline-tree",
            str(REPO), "--results-file", str(results)]
    assert prefill_host.main(argv) == 0
    out = capsys.readouterr().out
    assert describe_cpu() in out and "simulated device 0 ms/step" in out
    for mode in ("sync", "async"):
        lane = out.split(f"{mode} scheduling")[1]
        for tree in ("this tree", f"baseline {REPO}"):
            line = next(ln for ln in lane.splitlines() if ln.strip().startswith(f"{tree}:"))
            step = re.search(rf"per prefill step {NUMBER} / {NUMBER} / {NUMBER}", line)
            per_req = re.search(rf"per new request {NUMBER} / {NUMBER} / {NUMBER}", line)
            assert step and float(step.group(2)) > 0, line
            assert per_req and 0 < float(per_req.group(2)) <= float(step.group(2)), line
            counts = re.search(r"\((\d+) prefill steps of (\d+), (\d+) requests", line)
            assert counts and int(counts.group(3)) == 12, line
            assert 1 <= int(counts.group(1)) <= int(counts.group(2)), line
        cpu = re.search(rf"CPU per prefill step\s+{NUMBER} / {NUMBER} / {NUMBER}", lane)
        assert cpu and float(cpu.group(2)) > 0, lane
        assert re.search(rf"this tree / baseline {re.escape(str(REPO))} \(median per prefill "
                         rf"step\): {NUMBER}", lane)
    assert "--num-seqs 12" in results.read_text()
