"""Child processes of `deltaserve serve` / `scheduler` (the worker, the OpenAI gateway): they
get SIGTERM when we die, and are stopped with SIGTERM, then SIGKILL when they linger."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

# Runs in a fresh interpreter between our spawn and the child's program: it asks for SIGTERM when
# its parent dies, then execs the program (the death signal survives exec). Not a preexec_fn:
# that would run Python in a forked copy of this multi-threaded process, where gRPC's fork
# handlers and any lock another thread held at fork time make it unsafe (it aborted the OpenAI
# gateway's start once: "epoll_wait error: Bad file descriptor", exit code -6). With no
# preexec_fn, subprocess uses vfork and runs no fork handlers at all.
_EXEC_DYING_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(128 + signal.SIGTERM)  # the parent died before prctl: as if the signal came
os.execvp(sys.argv[2], sys.argv[2:])
"""


# Our own API key's variable (vllm_lists.given_keys): no child reads it (smg gets its keys on
# its stdin, smg_argv.py), and a child's environment is handed on to everything it starts.
_OUR_SECRETS = ("VLLM_API_KEY",)


def child_environment() -> dict[str, str]:
    """This process's environment without the variables that hold our secrets."""
    return {k: v for k, v in os.environ.items() if k not in _OUR_SECRETS}


def dying_with_parent(cmd: list[str]) -> list[str]:
    """`cmd` run so that it gets SIGTERM when this process dies (Linux; elsewhere it just runs).
    The child keeps the Popen's pid: the launcher execs into `cmd`."""
    if not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-I", "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *cmd]


def stop_process(proc: subprocess.Popen, timeout: float | None) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds (None: wait)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
