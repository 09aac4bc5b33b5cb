"""bench.moe_experts --cpu-kernels at tiny sizes: the grouped (on the panels), unreleased (on
the dense parameters), packed and transformers blocks are checked against each other, then
timed in alternating rounds with the dense MLP of the same active width, min / median / max per
path."""
from __future__ import annotations

import re

import pytest

from bench import moe_experts
from kernels.cpu import extension

pytestmark = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checks_then_times_three_paths_in_rounds(tmp_path, capsys, dtype):
    results = tmp_path / "results.md"
    argv = ["--device", "cpu", "--cpu-kernels", "--num-tokens", "1,6", "--experts", "8",
            "--top-k", "8", "--hidden", "64", "--inter", "40", "--iters", "1", "--warmup", "0",
            "--rounds", "2", "--dtype", dtype, "--results-file", str(results)]
    assert moe_experts.main(argv) == 0
    out = capsys.readouterr().out
    assert "CHECK FAILED" not in out
    for t in (1, 6):
        line = re.search(rf"^- T={t}: (.*)$", out, re.M)
        assert line, out
        for path in ("grouped", "unreleased", "packed", "transformers", "dense"):
            lo, mid, hi = map(float, re.search(rf"{path} ([\d.]+) / ([\d.]+) / ([\d.]+) ms",
                                               line.group(1)).groups())
            assert 0 < lo <= mid <= hi
        assert "(min / median / max of 2 rounds)" in line.group(1)
        assert re.search(r"unreleased / grouped [\d.]+ / [\d.]+ / [\d.]+x", line.group(1))
        assert line.group(1).endswith(f"; {t} rows an expert")      # T x top-8 / 8 experts
    assert f"E=8 top-8 H=64 I=40 {dtype}" in results.read_text()


def test_no_extra_times_the_grouped_paths_and_the_kernel_only(capsys):
    """--no-extra: grouped (on the panels), unreleased (the dense parameters) and packed,
    checked against each other; no transformers or dense MLP timing."""
    argv = ["--device", "cpu", "--cpu-kernels", "--no-extra", "--num-tokens", "40",
            "--experts", "4", "--top-k", "2", "--hidden", "64", "--inter", "40", "--iters", "1",
            "--warmup", "0", "--rounds", "1", "--dtype", "bfloat16"]
    assert moe_experts.main(argv) == 0
    line = re.search(r"^- T=40: (.*)$", capsys.readouterr().out, re.M).group(1)
    assert "CHECK FAILED" not in line and "unreleased " in line and "packed " in line
    assert "transformers" not in line and "dense" not in line and "20 rows an expert" in line


def test_cpu_kernels_mode_is_refused_off_the_cpu():
    with pytest.raises(SystemExit, match="--cpu-kernels needs --device cpu"):
        moe_experts.main(["--device", "cuda", "--cpu-kernels"])


def test_gpt_oss_block_is_checked_and_timed(capsys):
    """--gpt-oss: GPT-OSS's block (biases, clamped SwiGLU), packed checked against grouped and
    transformers' GptOssMLP before timing."""
    argv = ["--device", "cpu", "--cpu-kernels", "--gpt-oss", "--num-tokens", "1,5",
            "--experts", "6", "--top-k", "2", "--hidden", "64", "--inter", "40", "--iters", "1",
            "--warmup", "0", "--rounds", "1", "--dtype", "float32"]
    assert moe_experts.main(argv) == 0
    out = capsys.readouterr().out
    assert "GPT-OSS sparse block" in out and "E=6 top-2 H=64 I=40 float32" in out
    assert "CHECK FAILED" not in out and len(re.findall(r"^- T=\d+: grouped ", out, re.M)) == 2
    with pytest.raises(SystemExit, match="--gpt-oss needs --cpu-kernels"):
        moe_experts.main(["--device", "cpu", "--gpt-oss"])
