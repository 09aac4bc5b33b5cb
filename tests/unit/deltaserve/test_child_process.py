"""dying_with_parent: the launched program keeps the Popen's pid (the launcher execs into it) and
gets SIGTERM when the process that started it dies, with no preexec_fn run in a forked copy of
the parent."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from deltaserve.child_process import dying_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")

# The middle process: starts a child that would sleep for a minute, prints its pid, then waits.
_MIDDLE = """
import subprocess, sys
from deltaserve.child_process import dying_with_parent
child = subprocess.Popen(dying_with_parent([sys.executable, "-c",
                                            "import time; print('up', flush=True); time.sleep(60)"]),
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
assert child.stdout.readline() == "up\\n"
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_the_program_runs_under_the_popen_pid():
    popen = subprocess.Popen(dying_with_parent([sys.executable, "-c",
                                                "import os; print(os.getpid())"]),
                             stdout=subprocess.PIPE, text=True)
    out, _ = popen.communicate(timeout=60)
    assert popen.returncode == 0 and int(out) == popen.pid


def test_the_program_gets_sigterm_when_its_parent_is_killed():
    middle = subprocess.Popen([sys.executable, "-c", _MIDDLE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    exited = os.pidfd_open(child)   # readable once the child exits (it is not ours to wait for)
    try:
        middle.kill()
        middle.wait(30)
        ready, _, _ = select.select([exited], [], [], 60)
        if not ready:
            os.kill(child, signal.SIGKILL)
        assert ready, f"child {child} still ran 60 s after its parent was killed"
    finally:
        os.close(exited)
