"""A worker killed outright (SIGKILL, the OOM killer) must not leave its rank processes behind.
An idle rank notices its parent is gone at its next ring poll; this test kills the parent while
its rank is blocked where no ring is polled: in the torch.distributed rendezvous, waiting for a
node that never comes (up to --dist-timeout, 600 s here). The rank must still exit promptly."""
from __future__ import annotations

import os
import queue
import select
import signal
import subprocess
import sys
import threading

import pytest

from tests.support.paths import REPO
from tests.support.tp_harness import free_port

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open")


def _lines(stream, out: queue.SimpleQueue) -> None:
    for line in stream:
        out.put(line)


def test_a_rank_waiting_in_the_rendezvous_exits_when_its_worker_is_killed(tiny_models):
    parent = subprocess.Popen(
        [sys.executable, "-m", "tests.support.rank_parent", tiny_models("qwen3"),
         str(free_port())], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rank_fd = None
    try:
        rank_pid = int(parent.stdout.readline())
        rank_fd = os.pidfd_open(rank_pid)
        errors: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_lines, args=(parent.stderr, errors), daemon=True).start()
        while "joining gloo group" not in errors.get(timeout=240):
            pass                                           # the rank is in the rendezvous now
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        exited, _, _ = select.select([rank_fd], [], [], 120)
        if not exited:
            os.kill(rank_pid, signal.SIGKILL)
        assert exited, f"rank {rank_pid} outlived its killed worker"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if rank_fd is not None:
            os.close(rank_fd)
