"""The CPU the comparison runs on, and `--isa avx2`: an AVX2 machine emulated on a wider one.

Every result block names the CPU (model name, family/model numbers, the vector extensions it
has) and the ISA the run used. Under `--isa avx2` both engine processes get EMULATE_AVX2 in
their environment: our kernels built for x86-64-v3 (kernels/cpu/extension.py), torch's ATen
kernels at their AVX2 level, oneDNN and MKL capped at AVX2. What that does not reach (code that
asks the CPU itself, such as a peer's own kernels chosen by cpuid) is why the block says
"emulated" rather than "an AVX2 machine".

Stdlib only: the harness imports it before any engine runs.
"""
from __future__ import annotations

import os
import platform

ISAS = ("native", "avx2")
EMULATE_AVX2 = {
    "DELTASERVE_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
# the flags worth naming, widest first (/proc/cpuinfo spelling)
_NAMED_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "avx_vnni",
                "avx2", "fma", "f16c")


def isa_env(isa: str) -> dict[str, str]:
    """What both engine processes' environments get for `isa`."""
    if isa not in ISAS:
        raise ValueError(f"isa={isa!r} is not one of {', '.join(ISAS)}")
    return dict(EMULATE_AVX2) if isa == "avx2" else {}


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def widest_isa(flags: set[str]) -> str:
    """The widest vector ISA among the CPU's flags, in words."""
    if "avx512f" in flags:
        return "AVX-512"
    if {"avx2", "fma"} <= flags:
        return "AVX2 + FMA"
    return "no AVX2"


def describe_cpu(cores: int | None = None) -> str:
    """One line: model name, family/model, cores, the named flags it has, its widest ISA."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    name = info.get("model name") or platform.processor() or platform.machine()
    ids = (f", family {info['cpu family']} model {info['model']}"
           if "cpu family" in info and "model" in info else "")
    have = " ".join(f for f in _NAMED_FLAGS if f in flags) or "none named"
    return (f"{name}{ids}, {cores or os.cpu_count()} cores; flags: {have}; widest ISA "
            f"{widest_isa(flags)}")


def describe_run(isa: str) -> str:
    """The ISA line of a result block."""
    if isa == "native":
        return "ISA: native (each engine uses what this CPU has)"
    env = " ".join(f"{k}={v}" for k, v in EMULATE_AVX2.items())
    return (f"ISA: avx2, emulated on this CPU for both engines ({env}; DeltaServe's kernels "
            f"built for x86-64-v3), not a real AVX2 machine")
