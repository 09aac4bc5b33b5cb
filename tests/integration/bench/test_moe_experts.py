"""The MoE experts microbenchmark at tiny sizes (on CPU the fused kernels run in the Triton
interpreter; on a GPU machine the same run on CUDA, with the graph-replayed column)."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from bench import moe_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = ["--device", DEVICE, "--num-tokens", "1,9", "--experts", "8", "--top-k", "2",
        "--hidden", "64", "--inter", "32", "--iters", "1", "--warmup", "0"]


def test_checks_then_times_each_path(tmp_path, capsys):
    results = tmp_path / "results.md"
    assert moe_experts.main(TINY + ["--dtype", "float32", "--results-file", str(results)]) == 0
    out = capsys.readouterr().out
    for t in (1, 9):
        line = re.search(rf"^- T={t}: grouped ([\d.]+) ms, fused ([\d.]+) ms(.*)$", out, re.M)
        assert line, out
        assert float(line.group(1)) > 0 and float(line.group(2)) > 0
        assert ("fused graph" in line.group(3)) == (DEVICE == "cuda")
        error = float(re.search(r"\(error ([\d.e+-]+)\)", line.group(3)).group(1))
        assert error <= moe_experts.CHECK_TOL["float32"]
    assert "command: `python -m bench.moe_experts --device" in results.read_text()
