"""The MoE experts microbenchmark at tiny sizes (on CPU the fused kernels run in the Triton
interpreter; on a GPU machine the same run on CUDA, with the graph-replayed column), and its
tile-size overrides for a sweep."""
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


def test_tile_overrides_are_applied_and_checked(monkeypatch, capsys):
    from kernels import fused_moe as fm

    for name in ("BLOCK_N", "BLOCK_K", "SMALL_BLOCK_M"):      # restored after the test
        monkeypatch.setattr(fm, name, getattr(fm, name))
    argv = TINY + ["--dtype", "float32", "--block-n", "16", "--block-k", "16",
                   "--small-block-m", "32"]
    assert moe_experts.main(argv) == 0
    out = capsys.readouterr().out
    assert "- tiles: BLOCK_N 16, BLOCK_K 16, BLOCK_M 32 (pairs <= 4 x experts)" in out
    assert (fm.BLOCK_N, fm.BLOCK_K, fm.SMALL_BLOCK_M) == (16, 16, 32)
    assert out.count("(error ") == 2 and "CHECK FAILED" not in out
