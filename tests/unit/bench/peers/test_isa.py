"""bench/isa.py and its plumbing in the harness: --isa avx2 reaches both engines'
environments (vLLM's is only built here, never started), torch in such a process really runs at
AVX2, and every result block names the CPU and the ISA."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import isa
from bench.peers import harness
from bench.peers.report import Comparison, EngineRuns, format_block
from tests.support.paths import REPO

AVX2_VARS = {"DELTASERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
             "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_avx2_gives_both_engines_the_same_four_variables(tmp_path):
    assert isa.isa_env("avx2") == AVX2_VARS and isa.isa_env("native") == {}
    ours = harness.deltaserve_env(1, "avx2")
    peer = harness.vllm_env(1, 1.0, tmp_path, "avx2")
    for env in (ours, peer):
        assert {k: env[k] for k in AVX2_VARS} == AVX2_VARS
    assert ours["OMP_NUM_THREADS"] == "1" and peer["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_native_leaves_the_environment_as_it_is(tmp_path, monkeypatch):
    for key in AVX2_VARS:
        monkeypatch.delenv(key, raising=False)
    for env in (harness.deltaserve_env(2, "native"), harness.vllm_env(2, 1.0, tmp_path)):
        assert not set(AVX2_VARS) & set(env)


def test_an_unknown_isa_is_refused_by_name(capsys):
    with pytest.raises(ValueError, match="isa='avx512' is not one of native, avx2"):
        isa.isa_env("avx512")
    with pytest.raises(SystemExit):
        harness.build_parser().parse_args(["--isa", "sse2"])
    assert "--isa" in capsys.readouterr().err


@pytest.mark.slow
def test_torch_in_an_emulating_process_runs_at_avx2():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2" not in flags:
        pytest.skip("this CPU has no AVX2")
    code = ("import torch; from kernels.cpu import extension\n"
            "print(torch.backends.cpu.get_cpu_capability(), extension.isa())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, env=harness.deltaserve_env(1, "avx2"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AVX2", "avx2"]


def test_every_block_names_the_cpu_and_the_isa():
    lines = harness.platform_description("avx2")
    assert lines[0].startswith("cpu: ") and "widest ISA" in lines[0]
    assert lines[1].startswith("ISA: avx2, emulated on this CPU for both engines")
    assert "MKL_ENABLE_INSTRUCTIONS=AVX2" in lines[1]
    runs = EngineRuns("DeltaServe", "d", 1.0, [1.0], [[[1, 2]]])
    block = format_block([Comparison("w, float32, 1 thread", "w", None, [runs], None)],
                         "cmd", "abc", "cpu", lines)
    assert f"- {lines[0]}\n- {lines[1]}\n" in block
    assert harness.platform_description("native")[1].startswith("ISA: native")


def test_the_cpu_line_reads_the_model_and_the_widest_isa():
    assert isa.widest_isa({"avx512f", "avx2", "fma"}) == "AVX-512"
    assert isa.widest_isa({"avx2", "fma", "f16c"}) == "AVX2 + FMA"
    assert isa.widest_isa({"sse2"}) == "no AVX2"
    line = isa.describe_cpu(2)
    assert ", 2 cores; flags: " in line
    if os.path.exists("/proc/cpuinfo"):
        assert " family " in line and " model " in line


def test_the_vllm_process_hides_avx512_from_vllm_only_under_avx2(monkeypatch):
    """vLLM picks _C_AVX2 / _C_AVX512 / _C by torch.cpu's checks of the CPU itself, which
    ATEN_CPU_CAPABILITY does not change: under --isa avx2 its process answers them as an AVX2
    CPU would (here with our torch; the same torch.cpu functions in vLLM's)."""
    import torch

    from bench.peers import vllm_child

    for name in vllm_child._WIDER_THAN_AVX2:
        if hasattr(torch.cpu, name):
            monkeypatch.setattr(torch.cpu, name, getattr(torch.cpu, name))   # undone after
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert vllm_child.hide_wider_than_avx2() == []
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    changed = vllm_child.hide_wider_than_avx2()
    assert "_is_avx512_supported" in changed and "_is_avx512_bf16_supported" in changed
    assert not torch.cpu._is_avx512_supported() and not torch.cpu._is_avx512_bf16_supported()


def test_the_vllm_description_names_the_kernel_library_mapped_in(tmp_path):
    from bench.peers.vllm_child import loaded_kernel_libraries

    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 00:1 5 /v/lib/python3.11/site-packages/vllm/_C_AVX2.abi3.so\n"
                    "7f10-7f20 r--p 0 00:1 6 /usr/lib/libc.so.6\n")
    assert loaded_kernel_libraries(str(maps)) == "vllm._C_AVX2"
    maps.write_text("7f10-7f20 r--p 0 00:1 6 /usr/lib/libc.so.6\n")
    assert loaded_kernel_libraries(str(maps)) == ""
