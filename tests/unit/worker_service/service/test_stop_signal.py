"""run_worker stops on a SIGTERM that the kernel hands to one of its other threads, and stops
once, gracefully, under a burst of them.

The kernel may deliver a process-wide signal (PR_SET_PDEATHSIG's SIGTERM when `deltaserve
serve` is killed) to any thread; Python runs the handler only in the main thread, and a main
thread blocked in an untimed wait never got to it: the worker outlived its killed parent. And it
sends one such SIGTERM per thread of serve that exits: a handler re-entered while it held an
Event's lock blocked forever, and one that took any second signal for "exit now" skipped the
graceful stop. Ctrl-C twice still exits at once (engine_common/runtime/stop_signals.py)."""
from __future__ import annotations

import subprocess
import sys

from tests.support.grpc_harness import REPO, child_env

_CHILD = """
import logging, os, signal, sys, threading
from worker_service.service import server

logging.basicConfig(level=logging.INFO)     # "stopping worker" on stderr

def main_thread_blocked():
    tid = threading.main_thread().native_id
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"

def signal_this_thread():
    poll = threading.Event()        # never set: its timed wait is the polling interval
    while not (callable(signal.getsignal(signal.SIGTERM)) and main_thread_blocked()):
        poll.wait(0.01)
    if sys.argv[1] == "burst":      # as serve's threads die: SIGTERMs to the whole process
        pace = threading.Event()
        for _ in range(200):
            os.kill(os.getpid(), signal.SIGTERM)
            pace.wait(0.001)
    else:
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=signal_this_thread, daemon=True).start()
server.run_worker("127.0.0.1:0", grace_s=0.0)
print("worker stopped", flush=True)
"""


def _run_worker(mode: str) -> subprocess.CompletedProcess:
    # 120 s only bounds a hang: before the fixes the worker waited forever
    return subprocess.run([sys.executable, "-c", _CHILD, mode], cwd=REPO, env=child_env({}),
                          capture_output=True, text=True, timeout=120)


def test_a_sigterm_delivered_to_another_thread_stops_the_worker():
    done = _run_worker("one")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "worker stopped" in done.stdout


def test_a_burst_of_sigterms_stops_the_worker_once_and_gracefully():
    done = _run_worker("burst")
    assert done.returncode == 0, done.stderr[-2000:]     # not os._exit(1), not a hang
    assert "worker stopped" in done.stdout
    assert done.stderr.count("stopping worker") == 1, done.stderr[-2000:]


_CTRL_C_TWICE = """
import os, signal
from engine_common.runtime.stop_signals import StopSignals

signals = StopSignals()
os.kill(os.getpid(), signal.SIGINT)
print("first", signals.wait() == signal.SIGINT, flush=True)
os.kill(os.getpid(), signal.SIGTERM)        # ignored: the stop is under way
print("after sigterm", flush=True)
os.kill(os.getpid(), signal.SIGINT)         # the user insists: out now
print("survived the second ctrl-c", flush=True)
"""


def test_a_second_ctrl_c_exits_at_once_and_a_repeated_sigterm_does_not():
    done = subprocess.run([sys.executable, "-c", _CTRL_C_TWICE], cwd=REPO, env=child_env({}),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["first True", "after sigterm"], done.stdout
