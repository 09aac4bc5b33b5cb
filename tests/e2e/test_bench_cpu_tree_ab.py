"""bench.cpu_tree_ab end to end: the real default model in fresh child processes, this tree
alternating with a baseline checkout (this one again); tok/s for both trees and their ratio,
printed and appended."""
from __future__ import annotations

import re

from bench import cpu_tree_ab
from bench.isa import describe_cpu
from tests.support.paths import REPO

NUMBER = r"([\d.]+)"


def test_each_tree_reports_tokens_per_second_and_the_ratio(tmp_path, capsys):
    results = tmp_path / "results.md"
    argv = ["--workload", "decode-heavy", "--num-seqs", "4", "--max-output", "3", "--rounds",
            "1", "--baseline-tree", str(REPO), "--results-file", str(results)]
    assert cpu_tree_ab.main(argv) == 0
    out = capsys.readouterr().out
    # decode-heavy's outputs are 256-512 tokens: every one capped at 3, ignore_eos
    assert describe_cpu() in out and "decode-heavy: 4 requests, 12 output tokens" in out
    for tree in ("this tree", f"baseline {REPO}"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"- {tree}:"))
        rate = re.search(rf"{NUMBER} / {NUMBER} / {NUMBER} tok/s", line)
        assert rate and float(rate.group(2)) > 0, line
    ratio = re.search(rf"this tree / baseline {re.escape(str(REPO))} \(median tok/s\): "
                      rf"{NUMBER}x", out)
    assert ratio and float(ratio.group(1)) > 0, out
    assert "--max-output 3" in results.read_text()
