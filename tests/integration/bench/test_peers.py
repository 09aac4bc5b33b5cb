"""`make bench-peers`' DeltaServe side on the smoke workload (what CI runs; vLLM is never
installed or started here): both DeltaServe paths in their own processes, alternating rounds,
the roofline line, the results block."""
from __future__ import annotations

import re

import pytest

from bench.peers import harness
from bench.peers.vllm_venv import VenvError, find_or_install


@pytest.mark.slow
def test_smoke_runs_deltaserve_in_process_and_over_grpc(tmp_path, capsys, bench_presets):
    results = tmp_path / "results.md"
    argv = ["--workload", "smoke", "--engines", "deltaserve", "--grpc", "--rounds", "2",
            "--cache-dir", str(bench_presets), "--results-file", str(results),
            "--work-dir", str(tmp_path / "work")]
    assert harness.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"round 1: DeltaServe gRPC: [\d.]+ tok/s", out)
    assert re.search(r"^DeltaServe: [\d.]+ tok/s median .* over 2 rounds; .* of the roofline "
                     r"floor$", out, re.M), out
    assert re.search(r"roofline floor: [\d.]+ s = .* GFLOP/s .* GB/s copy bandwidth", out)
    assert "greedy tokens, DeltaServe gRPC vs DeltaServe: 8/8 requests identical" in out
    assert "WARNING" not in out
    # Every round starts cold on both paths: in-process reset, FlushCache over gRPC.
    assert "prefix caching on, emptied before each run (FlushCache)" in out
    text = results.read_text()
    assert "· bench-peers ·" in text and "| smoke, float32, 1 thread, DeltaServe |" in text
    assert (tmp_path / "work" / "smoke-DeltaServe.log").exists()


@pytest.mark.slow
def test_isa_avx2_runs_deltaserve_on_its_avx2_build_and_says_so(tmp_path, capsys,
                                                                bench_presets):
    """--isa avx2 on whatever CPU this is: the engine process loads the AVX2 kernels (built
    without AVX-512) with torch at AVX2, and the results block names the CPU and the ISA."""
    from kernels.cpu import extension

    if extension.cannot_run("avx2") or not extension.load("avx2"):
        pytest.skip(extension.cannot_run("avx2") or extension.status("avx2"))
    results = tmp_path / "results.md"
    argv = ["--workload", "smoke", "--engines", "deltaserve", "--isa", "avx2", "--rounds", "1",
            "--no-roofline", "--cache-dir", str(bench_presets),
            "--results-file", str(results), "--work-dir", str(tmp_path / "work")]
    assert harness.main(argv) == 0
    out = capsys.readouterr().out
    assert "deltaserve_cpu avx2 build (avx2 bodies), torch CPU capability AVX2" in out, out
    text = results.read_text()
    assert re.search(r"^- cpu: .*widest ISA", text, re.M)
    assert "- ISA: avx2, emulated on this CPU for both engines" in text


def test_a_missing_vllm_venv_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(VenvError, match="does not exist"):
        find_or_install(tmp_path / "nowhere")
    argv = ["--workload", "smoke", "--vllm-venv", str(tmp_path / "nowhere")]
    assert harness.main(argv) == 2
    assert "bench-peers: error: vllm_venv=" in capsys.readouterr().err


def test_bad_flags_exit_2(capsys):
    assert harness.main(["--engines", "sglang"]) == 2
    assert "engines" in capsys.readouterr().err
    assert harness.main(["--workloads", "nope", "--engines", "deltaserve"]) == 2
