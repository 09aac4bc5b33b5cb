"""The deltaserve_cpu library builds and loads on this machine (make install builds it; CI has
a compiler), unless it was switched off with DELTASERVE_CPU_EXT=0; when it cannot load, every
caller gets a clean fallback."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels.cpu import extension
from tests.support.paths import REPO


@pytest.mark.skipif(os.environ.get(extension.ENV_SWITCH) == "0", reason="switched off")
def test_library_loads_and_registers_its_ops():
    assert extension.load(), extension.status()
    assert extension.status() == "loaded"
    for name in ("paged_attention", "mkl_pack", "mkl_packed_linear", "mkl_bf16_linear",
                 "rms_norm", "add_rms_norm", "rope", "silu_and_mul", "greedy_sample"):
        assert hasattr(extension.ops(), name), name
    assert extension.ops().mkl_sgemm_packed_available()


def test_library_name_follows_sources_and_cpu():
    name = extension.library_name("native")
    assert name.startswith("deltaserve_cpu_") and len(name) == len("deltaserve_cpu_") + 16
    assert name == extension.library_name("native")
    avx2 = extension.library_name("avx2")
    assert avx2.startswith("deltaserve_cpu_avx2_") and avx2[-16:] != name[-16:]
    assert extension.namespace("generic") == "deltaserve_cpu_generic"


def test_every_source_and_header_is_in_the_library_name():
    """An edited header must rebuild the library: a file left out of SOURCES/HEADERS would let
    a stale build load under the old name."""
    on_disk = {p.name for p in extension.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == set(extension.SOURCES + extension.HEADERS)


def _native_body() -> str:
    flags = set(extension.cpu_flags().split())
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "generic"


@pytest.mark.skipif(os.environ.get(extension.ENV_SWITCH) == "0", reason="switched off")
def test_the_native_build_compiles_the_widest_body_this_cpu_has():
    assert extension.load("native"), extension.status("native")
    assert extension.ops("native").body() == _native_body()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(extension.ENV_SWITCH) == "0", reason="switched off")
@pytest.mark.parametrize("which", ["avx2", "generic"])
def test_a_narrower_build_loads_beside_the_native_one_with_its_own_body(which):
    """Both libraries in one process, each answering with its own code (no symbol of one
    taken by the other)."""
    if extension.cannot_run(which):
        pytest.skip(extension.cannot_run(which))
    assert extension.load("native") and extension.load(which), extension.status(which)
    assert extension.ops(which).body() == which
    assert extension.ops("native").body() == _native_body()


@pytest.mark.skipif(os.environ.get(extension.ENV_SWITCH) == "0", reason="switched off")
def test_avx2_body_names_the_loaded_builds_body_parsing_the_flags_once(monkeypatch):
    """avx2_body() (told from the flags before any load) agrees with the library's own
    body(); linear.panel_max_rows asks it on every linear call, so the flags are split once
    per ISA, not once a call."""
    from kernels.cpu import linear

    monkeypatch.setattr(extension, "_selected", "native")
    assert extension.load("native"), extension.status("native")
    assert extension.avx2_body() == (extension.ops("native").body() == "avx2")
    monkeypatch.setattr(extension, "_selected", "avx2")      # the avx2 build's body, anywhere
    assert extension.avx2_body()
    monkeypatch.setattr(extension, "_selected", "generic")
    assert not extension.avx2_body()

    class Flags(str):
        splits = 0

        def split(self, *args):
            Flags.splits += 1
            return super().split(*args)

    monkeypatch.setattr(extension, "cpu_flags", lambda: Flags("avx2 f16c fma sse4_2 zen4"))
    monkeypatch.setattr(extension, "_selected", "native")
    threads = torch.get_num_threads() > 1
    for _ in range(20):
        assert linear.panel_max_rows(torch.float32) == linear.PANEL_MAX_ROWS[
            "avx2", "mkl", threads][torch.float32]
    assert Flags.splits <= 1


def test_an_unknown_isa_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(extension, "_selected", None)
    monkeypatch.setenv(extension.ISA_VAR, "avx9")
    with pytest.raises(ValueError, match="DELTASERVE_CPU_ISA='avx9' is not one of native, "
                                         "avx2, generic"):
        extension.isa()
    monkeypatch.setattr(extension, "_selected", None)
    monkeypatch.setenv(extension.ISA_VAR, "avx2")
    assert extension.isa() == "avx2" and extension.namespace() == "deltaserve_cpu_avx2"


@pytest.mark.slow   # a fresh process importing torch: 1.5-8 s on a shared 2-core machine
def test_switched_off_library_leaves_the_torch_fallbacks():
    code = ("from kernels.cpu import extension, fused, linear; import torch\n"
            "assert not extension.load() and extension.status() == 'DELTASERVE_CPU_EXT=0'\n"
            "assert fused.ops_for(torch.float32) is None\n"
            "assert linear.prepare(torch.zeros(4, 4)) is None\n"
            "from kernels.attention.selector import resolve_backend_name\n"
            "assert resolve_backend_name('auto', 'cpu') == 'torch'\n")
    env = {**os.environ, extension.ENV_SWITCH: "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_failed_build_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.setattr(extension, "SOURCES", ("missing.cpp",))
    monkeypatch.delenv(extension.ENV_SWITCH, raising=False)
    assert extension.load() is False
    assert "missing.cpp" in extension.status()
    assert torch.ops.deltaserve_cpu is not None       # the loaded library (if any) stays usable


def test_build_root_prefers_its_own_variable_over_the_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv(extension.DIR_VAR, str(tmp_path / "ext"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert extension.build_root() == tmp_path / "ext"
    monkeypatch.delenv(extension.DIR_VAR)
    assert extension.build_root() == tmp_path / "xdg" / "deltaserve" / "cpu_ext"


@pytest.mark.slow   # a fresh process importing torch: 1.5-7 s on a shared 2-core machine
@pytest.mark.skipif(os.environ.get(extension.ENV_SWITCH) == "0", reason="switched off")
def test_a_lock_file_left_by_a_killed_builder_does_not_block_loading():
    """torch's lock file, as a process killed mid-load leaves it: a new process still loads."""
    assert extension.load(), extension.status()
    stale = extension.build_root() / extension.library_name() / "lock"
    stale.touch()
    try:
        code = ("from kernels.cpu import extension\n"
                "assert extension.load(), extension.status()\n")
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                              timeout=300)
        assert done.returncode == 0, done.stderr
    finally:
        stale.unlink(missing_ok=True)


def test_needs_build_says_whether_a_load_would_compile_first(tmp_path, monkeypatch):
    """True for an empty build cache (the worker then says "building CPU kernels" while it
    compiles); False once the library file is there, once loaded, or when switched off."""
    monkeypatch.setattr(extension, "_state", {})
    monkeypatch.delenv(extension.ENV_SWITCH, raising=False)
    monkeypatch.setenv(extension.DIR_VAR, str(tmp_path))
    assert extension.needs_build("generic")
    name = extension.library_name("generic")
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"")
    assert not extension.needs_build("generic")
    (tmp_path / name / f"{name}.so").unlink()
    monkeypatch.setenv(extension.ENV_SWITCH, "0")
    assert not extension.needs_build("generic")
    monkeypatch.delenv(extension.ENV_SWITCH)
    extension._state["generic"] = {"ok": True, "why": "loaded"}
    assert not extension.needs_build("generic")
