"""run_worker stops on a SIGTERM that the kernel hands to one of its other threads.

The kernel may deliver a process-wide signal (PR_SET_PDEATHSIG's SIGTERM when `deltaserve
serve` is killed) to any thread; Python runs the handler only in the main thread, and a main
thread blocked in an untimed wait never got to it: the worker outlived its killed parent. Here a
helper thread sends SIGTERM to itself once the handlers are in place, so the signal reaches a
thread other than the main one by construction, once the main thread sleeps in its wait."""
from __future__ import annotations

import subprocess
import sys

from tests.support.grpc_harness import REPO, child_env

_CHILD = """
import signal, threading
from worker_service.service import server

def main_thread_blocked():
    tid = threading.main_thread().native_id
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"

def signal_this_thread():
    poll = threading.Event()        # never set: its timed wait is the polling interval
    while not (callable(signal.getsignal(signal.SIGTERM)) and main_thread_blocked()):
        poll.wait(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=signal_this_thread, daemon=True).start()
server.run_worker("127.0.0.1:0", grace_s=0.0)
print("worker stopped", flush=True)
"""


def test_a_sigterm_delivered_to_another_thread_stops_the_worker():
    # 120 s only bounds a hang: before the fix the worker waited forever
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=child_env({}),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "worker stopped" in done.stdout
