"""The norm/rope microbenchmark at tiny sizes (on CPU the Triton kernels run in the interpreter;
on a GPU machine the same run on CUDA), and bench.throughput's --fused-ops flag."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from bench import fused_ops  # noqa: E402
from bench import throughput  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = ["--device", DEVICE, "--num-tokens", "3,5", "--hidden", "48", "--num-heads", "4",
        "--num-kv-heads", "2", "--head-dim", "16", "--iters", "2", "--warmup", "1"]
OPS = ("rms_norm", "add+rms_norm", "head norm", "rope")
FIGURE = r"([\d.]+(?:e[+-]?\d+)?)"


def test_checks_then_prints_the_table_and_appends_block(tmp_path, capsys):
    results = tmp_path / "results.md"
    assert fused_ops.main(TINY + ["--results-file", str(results), "--note", "smoke"]) == 0
    out = capsys.readouterr().out
    checks = re.search(r"^checks \(fused vs torch.*$", out, re.M)
    table = out.index("| op | T | torch ms | fused ms | speedup (torch/fused)")
    assert checks and checks.start() < table, "every op is checked before the timings"
    for op in OPS:
        for t in (3, 5):
            assert re.search(rf"{re.escape(op)} T={t} {FIGURE} \(ok\)", checks.group(0)), op
            row = re.search(rf"^\| {re.escape(op)} \| {t} \|(.*)\|$", out, re.M)
            assert row, f"no row for {op} T={t}:\n{out}"
            cells = [c.strip().removesuffix("x") for c in row.group(1).split("|")]
            assert len(cells) == 6 and all(float(c) > 0 for c in cells), row.group(0)
    text = results.read_text()
    assert re.search(rf"^## .* · fused norm \+ rope · {DEVICE} \(.+\)$", text, re.M)
    assert "- command: `python -m bench.fused_ops --device" in text
    assert "- note: smoke" in text and "| rope | 5 |" in text


def test_failed_check_times_nothing_and_exits_1(tmp_path, capsys):
    """float32 norms differ from torch's by a few ulps (another summation order), so a zero
    tolerance fails them; the rope agrees bit for bit."""
    argv = TINY + ["--dtype", "float32", "--check-tol", "0", "--results-file",
                   str(tmp_path / "r.md")]
    assert fused_ops.main(argv) == 1
    out = capsys.readouterr().out
    assert "rms_norm T=3" in out and "(FAILED)" in out
    if DEVICE == "cpu":
        assert "rope T=3 0.00e+00 (ok)" in out
    assert "verification FAILED: nothing timed" in out and "| op |" not in out


@pytest.mark.parametrize("flags,field", [
    (["--head-dim", "15"], "head_dim"),
    (["--num-tokens", "4,x"], "num_tokens"),
    (["--num-tokens", "0"], "num_tokens"),
    (["--check-tol", "-1"], "check_tol"),
])
def test_bad_flags_are_typed_errors(tmp_path, capsys, flags, field):
    assert fused_ops.main(["--device", "cpu", *flags, "--results-file",
                           str(tmp_path / "r.md")]) == 2
    assert f"{field}=" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


def test_throughput_fused_ops_flag_reaches_the_engine_kwargs():
    args = throughput.build_parser().parse_args(["--fused-ops"])
    kwargs, _ = throughput._llm_kwargs(args, "cpu", 64)
    assert kwargs["fused_ops"] is True
    plain = throughput.build_parser().parse_args([])
    assert "fused_ops" not in throughput._llm_kwargs(plain, "cpu", 64)[0]


def test_throughput_with_fused_ops_runs_the_fused_model(tmp_path, capsys, bench_presets):
    # A fixed 16 MiB KV budget: on CUDA the default profiles 0.9 of the GPU, millions of the
    # tiny model's 8 KiB blocks (seconds of block-pool set-up in the scheduler).
    argv = ["--preset", "tiny", "--device", DEVICE, "--num-seqs", "2", "--min-len", "4",
            "--max-len", "6", "--fused-ops", "--cache-dir", str(bench_presets),
            "--kv-cache-gib", str(16 / 1024), "--results-file", str(tmp_path / "r.md")]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^output tokens: 8$", out, re.M), out
    assert re.search(r"^engine: .*, fused Triton norm \+ rope \+ silu,", out, re.M), out
