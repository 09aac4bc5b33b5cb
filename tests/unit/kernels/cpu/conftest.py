"""`cpu_isa`: runs a kernel test once per body this machine can execute (kernels/cpu/extension.py
ISAS): the native build (AVX-512 where the CPU has it), the AVX2 build (x86-64-v3; on an AVX-512
machine, so the AVX2 code is checked there too) and the generic build (the portable loops). The
narrower builds are compiled once per cache (about 30 s each on 2 cores), so their cases are in
the slow lane."""
from __future__ import annotations

import pytest

from kernels.cpu import extension

ISA_PARAMS = ["native", pytest.param("avx2", marks=pytest.mark.slow),
              pytest.param("generic", marks=pytest.mark.slow)]


@pytest.fixture(params=ISA_PARAMS)
def cpu_isa(request, monkeypatch):
    """Makes request.param's build the one extension.ops() / load() give (children too)."""
    which = request.param
    why = extension.cannot_run(which)
    if why:
        pytest.skip(why)
    if not extension.load(which):
        pytest.fail(f"the {which} build did not load: {extension.status(which)}")
    monkeypatch.setattr(extension, "_selected", which)
    monkeypatch.setenv(extension.ISA_VAR, which)
    return which


@pytest.fixture
def ops(cpu_isa):
    """The op namespace of the build under test."""
    return extension.ops(cpu_isa)
