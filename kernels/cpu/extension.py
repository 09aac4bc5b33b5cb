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

DELTASERVE_CPU_ISA picks the instruction set the library is built for (ISAS): "native" (this
CPU's widest: the AVX-512 bodies where it has them), "avx2" (AVX2 + FMA + F16C, x86-64-v3: an
AVX2 machine's build, emulated on a wider one) or "generic" (the compiler's default target: the
portable loops). Each gets its own library name and op namespace (torch.ops.deltaserve_cpu,
deltaserve_cpu_avx2, deltaserve_cpu_generic), so one process can load several (the kernel tests
run every body the machine can execute).
"""
from __future__ import annotations

import fcntl
import functools
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
           "panel_gemm.cpp", "panel_gemm_bf16dot.cpp", "screened_greedy.cpp", "moe_experts.cpp",
           "int4_gemm.cpp")
HEADERS = ("vec_math.h", "simd.h", "attention_item.h", "attention_portable.h", "attention_simd.h",
           "attention_bf16dot.h", "attention_latent.h", "row_argmax.h", "float_bounds.h",
           "attention_fp8.h")
# -fno-trapping-math: without AVX-512's masked operations GCC turns a select over a computed
# value (exp_approx's underflow guard, silu's sign cases) into a branch and leaves the loop
# scalar; no value changes (it only lets a result be computed before it is known to be needed).
# silu_and_mul on the AVX2 build: 1.44 -> 0.17 ms at [256, 1536] (Sapphire Rapids, emulated AVX2).
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wno-unknown-pragmas")
ISA_CFLAGS = {
    "native": ("-march=native", "-mprefer-vector-width=512"),
    "avx2": ("-march=x86-64-v3", "-mtune=native", "-mprefer-vector-width=256"),
    "generic": (),
}
ISAS = tuple(ISA_CFLAGS)
AVX2_NEEDS = ("avx2", "fma", "f16c")     # CPU flags (/proc/cpuinfo) the avx2 build's code uses
ENV_SWITCH = "DELTASERVE_CPU_EXT"
ISA_VAR = "DELTASERVE_CPU_ISA"
DIR_VAR = "DELTASERVE_CPU_EXT_DIR"   # where builds go (tests point children at the built one)

_lock = threading.Lock()
_state: dict[str, dict] = {}         # per ISA: ok, why
_selected: str | None = None         # the process's ISA once read from $DELTASERVE_CPU_ISA


@functools.cache
def cpu_flags() -> str:
    """The CPU's flags as /proc/cpuinfo spells them, sorted and space-separated (read once:
    every linear layer asks at load)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa() -> str:
    """The ISA this process's kernels are built for: $DELTASERVE_CPU_ISA, else "native"."""
    global _selected
    if _selected is None:
        value = os.environ.get(ISA_VAR) or "native"
        if value not in ISAS:
            raise ValueError(f"{ISA_VAR}={value!r} is not one of {', '.join(ISAS)}")
        _selected = value
    return _selected


def avx2_body() -> bool:
    """Whether this process's kernels run their AVX2 bodies (simd.h's 256-bit vectors): the
    avx2 build, or the native one on a CPU with AVX2 + FMA and no AVX-512. Told from the CPU's
    flags, without loading the library; asked on every linear call (linear.panel_max_rows),
    so the flags are parsed once per ISA."""
    return _avx2_body(isa(), cpu_flags())


@functools.cache
def _avx2_body(which: str, flags: str) -> bool:
    if which == "avx2":
        return True
    have = set(flags.split())
    return which == "native" and "avx512f" not in have and {"avx2", "fma"} <= have


def namespace(which: str | None = None) -> str:
    """The op namespace of an ISA's build: deltaserve_cpu (native), deltaserve_cpu_<isa>."""
    which = which or isa()
    return "deltaserve_cpu" if which == "native" else f"deltaserve_cpu_{which}"


def cannot_run(which: str) -> str | None:
    """Why this machine cannot run (or has no use for) the `which` build, else None."""
    if which != "avx2":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"avx2 is an x86-64 build; this machine is {platform.machine()}"
    flags = set(cpu_flags().split())
    missing = [f for f in AVX2_NEEDS if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)} for the avx2 build"
    if "avx512f" not in flags:
        return "the native build is already the AVX2 one (no AVX-512 here)"
    return None


def library_name(which: str | None = None) -> str:
    """deltaserve_cpu_<hash of what the build depends on> (native), deltaserve_cpu_<isa>_<hash>."""
    which = which or isa()
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join((str(CSRC), torch.__version__, sys.version, *_cflags(which),
                       cpu_flags())).encode())
    return f"{namespace(which)}_{h.hexdigest()[:16]}"


def _cflags(which: str) -> list[str]:
    return [*CFLAGS, *ISA_CFLAGS[which], f"-DDELTASERVE_CPU_NS={namespace(which)}"]


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


def _build_and_load(which: str) -> None:
    name = library_name(which)
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
        _compile_and_load(name, build_dir, which)


def _compile_and_load(name: str, build_dir: Path, which: str) -> None:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    cpp_extension.load(name=name, sources=[str(CSRC / s) for s in SOURCES],
                       extra_cflags=_cflags(which), extra_ldflags=["-fopenmp"],
                       build_directory=str(build_dir), is_python_module=False, verbose=False)


def needs_build(which: str | None = None) -> bool:
    """True when load() would compile the library first (1-3 minutes): not loaded in this
    process, not switched off, and no built file in the cache."""
    which = which or isa()
    if "ok" in _state.get(which, {}) or os.environ.get(ENV_SWITCH, "") == "0":
        return False
    name = library_name(which)
    return not (build_root() / name / f"{name}.so").exists()


def load(which: str | None = None) -> bool:
    """Build (if needed) and load the library for an ISA (default: the process's, isa()) once
    per process; True when its ops are ready."""
    which = which or isa()
    with _lock:
        state = _state.setdefault(which, {})
        if "ok" in state:
            return state["ok"]
        switch = os.environ.get(ENV_SWITCH, "")
        if switch == "0":
            state.update(ok=False, why=f"{ENV_SWITCH}=0")
            return False
        try:
            _build_and_load(which)
            state.update(ok=True, why="loaded")
        except Exception as e:  # noqa: BLE001 - any failure means "use the fallback"
            if switch == "1":
                raise
            state.update(ok=False, why=f"{type(e).__name__}: {str(e).strip()[-400:]}")
            log.warning("deltaserve_cpu kernels (%s) unavailable, using torch fallbacks: %s",
                        which, state["why"])
        return state["ok"]


def status(which: str | None = None) -> str:
    """Why the library is or is not in use ("loaded", or the failure)."""
    return _state.get(which or isa(), {}).get("why", "not loaded yet")


def ops(which: str | None = None):
    """torch.ops.deltaserve_cpu, or the namespace of another ISA's build (call load() first)."""
    return getattr(torch.ops, namespace(which))


if __name__ == "__main__":      # `make install`: build it now rather than at first use
    ok = load()
    print(f"deltaserve_cpu kernels ({isa()}): {status()}"
          + ("" if ok else " (torch fallbacks in use)"))
