"""Build and load the `deltaserve_cpu` operator library from csrc/ with torch.utils.cpp_extension.

The library is compiled once per (sources, torch version, compiler flags, CPU feature set) into
$DELTASERVE_CPU_EXT_DIR/<name>, else $XDG_CACHE_HOME/deltaserve/cpu_ext/<name> (or ~/.cache/...),
by `make install` (`python -m kernels.cpu.extension`) or else at first use (about a minute on
2 cores). `-march=native` is safe because the CPU's feature flags are part of the name: another
CPU builds its own copy; so is the checkout's csrc path, so two checkouts never rebuild each
other's copy.

NOTE: a built library is loaded directly, never through cpp_extension.load(): that takes torch's
lock file ("lock" in the build directory) on every load, and a process killed while holding it
(a worker SIGKILLed during start-up) left every later load waiting forever. Builds are kept apart
by our own flock, which the kernel releases when its holder dies; a torch lock file found while
holding it is stale and removed.

If anything fails (no compiler, no ninja, a build error), `load()` returns None, `status()`
says why, and every caller falls back to torch (kernels/attention/torch_ref.py, F.linear).
DELTASERVE_CPU_EXT=0 turns the library off (the fallbacks run); =1 makes a failure an error.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "paged_attention.cpp", "mkl_linear.cpp", "elementwise.cpp",
           "panel_gemm.cpp")
HEADERS = ("vec_math.h", "exp512.h", "attention_avx512.h", "row_argmax.h")
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno",
          "-Wno-unknown-pragmas")
ENV_SWITCH = "DELTASERVE_CPU_EXT"
DIR_VAR = "DELTASERVE_CPU_EXT_DIR"   # where builds go (tests point children at the built one)

_lock = threading.Lock()
_state: dict = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_name() -> str:
    """deltaserve_cpu_<hash of what the build depends on>."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join((str(CSRC), torch.__version__, sys.version, *CFLAGS,
                       _cpu_flags())).encode())
    return "deltaserve_cpu_" + h.hexdigest()[:16]


def build_root() -> Path:
    """$DELTASERVE_CPU_EXT_DIR, else $XDG_CACHE_HOME/deltaserve/cpu_ext (~/.cache/...)."""
    if os.environ.get(DIR_VAR):
        return Path(os.environ[DIR_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deltaserve" / "cpu_ext"


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is not there unless the
    virtualenv is activated."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # noqa: F401 - pip's ninja package
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@contextmanager
def _build_lock(build_dir: Path):
    """An exclusive flock on build_dir/.build.lock for as long as the block runs."""
    with open(build_dir / ".build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_and_load() -> None:
    name = library_name()
    build_dir = build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    with _build_lock(build_dir):
        if library.exists():
            try:
                torch.ops.load_library(str(library))
                return
            except OSError as e:        # a truncated file from a killed link: build again
                log.warning("rebuilding %s: %s", library, e)
                library.unlink()
        (build_dir / "lock").unlink(missing_ok=True)     # torch's, left by a killed builder
        _compile_and_load(name, build_dir)


def _compile_and_load(name: str, build_dir: Path) -> None:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES],
                       extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                       build_directory=str(build_dir), is_python_module=False, verbose=False)


def load() -> bool:
    """Build (if needed) and load the library once per process; True when its ops are ready."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        switch = os.environ.get(ENV_SWITCH, "")
        if switch == "0":
            _state.update(ok=False, why=f"{ENV_SWITCH}=0")
            return False
        try:
            _build_and_load()
            _state.update(ok=True, why="loaded")
        except Exception as e:  # noqa: BLE001 - any failure means "use the fallback"
            if switch == "1":
                raise
            _state.update(ok=False, why=f"{type(e).__name__}: {str(e).strip()[-400:]}")
            log.warning("deltaserve_cpu kernels unavailable, using torch fallbacks: %s",
                        _state["why"])
        return _state["ok"]


def status() -> str:
    """Why the library is or is not in use ("loaded", or the failure)."""
    return _state.get("why", "not loaded yet")


def ops():
    """torch.ops.deltaserve_cpu (call load() first)."""
    return torch.ops.deltaserve_cpu


if __name__ == "__main__":      # `make install`: build it now rather than at first use
    ok = load()
    print(f"deltaserve_cpu kernels: {status()}" + ("" if ok else " (torch fallbacks in use)"))
