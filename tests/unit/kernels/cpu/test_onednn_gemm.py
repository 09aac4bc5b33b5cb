"""kernels/cpu/onednn_gemm.wanted on CPUs other than this one (their flags stood in): which
builds send their many-row calls to oneDNN, from the CPU, the build's ISA and oneDNN's own ISA
cap. The GEMM itself against F.linear: tests/unit/kernels/cpu/test_linear.py."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension, onednn_gemm

pytestmark = pytest.mark.skipif(not onednn_gemm._available(), reason="torch has no oneDNN")

FLAGS = {"avx2": "avx avx2 f16c fma sse4_2",
         "avx512": "avx avx2 avx512_bf16 avx512bw avx512dq avx512f avx512vl f16c fma sse4_2"}


@pytest.mark.parametrize("cpu, isa, cap, want", [
    ("avx512", "native", None, (True, True)),
    ("avx2", "native", None, (True, False)),        # an AVX2 core: float32 only
    # the avx2 build emulated: oneDNN uncapped runs its AVX-512 kernels, so MKL keeps the rows;
    # capped at AVX2 (make test-avx2, bench --isa avx2) it chooses as the AVX2 core does
    ("avx512", "avx2", None, (False, False)),
    ("avx512", "avx2", ("ONEDNN_MAX_CPU_ISA", "AVX2"), (True, False)),
    ("avx512", "avx2", ("ONEDNN_MAX_CPU_ISA", "avx2_vnni"), (True, False)),
    ("avx512", "avx2", ("DNNL_MAX_CPU_ISA", "AVX2"), (True, False)),
    ("avx512", "avx2", ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE"), (False, False)),
    ("avx512", "generic", ("ONEDNN_MAX_CPU_ISA", "AVX2"), (False, False)),
])
def test_wanted_follows_the_cpu_the_build_and_onednns_cap(monkeypatch, cpu, isa, cap, want):
    monkeypatch.delenv(onednn_gemm.ENV_SWITCH, raising=False)
    for var in onednn_gemm.ISA_CAP_VARS:
        monkeypatch.delenv(var, raising=False)
    if cap:
        monkeypatch.setenv(*cap)
    monkeypatch.setattr(extension, "cpu_flags", lambda: FLAGS[cpu])
    monkeypatch.setattr(extension, "_selected", isa)
    assert (onednn_gemm.wanted(torch.float32), onednn_gemm.wanted(torch.bfloat16)) == want
