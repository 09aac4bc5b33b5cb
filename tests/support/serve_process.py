"""`deltaserve serve` as a child process of a test: its output in a log file, its readiness,
its stop; and the /proc views of its children (the worker, the smg gateway)."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.support.grpc_harness import REPO, child_env, free_port, wait_for


def children(pid: int) -> list[int]:
    """The child process ids of `pid`."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts as exited)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in "ZX"
    except (FileNotFoundError, IndexError):
        return True


class ServeProcess:
    """`python -m deltaserve.cli serve *args`, its output collected in `log`."""

    def __init__(self, log: Path, args: list[str], env: dict | None = None):
        self.log = log
        cmd = [sys.executable, "-m", "deltaserve.cli", "serve", *args]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                         env=child_env(env))

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> str:
        def ready():
            assert self.proc.poll() is None, self.text()
            return "DeltaServe ready on" in self.text()
        wait_for(ready, timeout, "the ready line")
        return self.text()

    def stop(self) -> None:
        """Ctrl-C (SIGINT), then SIGKILL when it has not exited in 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class GrpcServe(ServeProcess):
    """`deltaserve serve` on free loopback ports, gRPC only, with a small KV cache (0.05 GiB:
    ~450 blocks of 16 tokens of the default model); the default model unless `flags` name
    another. wait_ready() allows a first start on a loaded 2-core machine."""

    KV_GIB = "0.05"
    READY_TIMEOUT = 300

    def __init__(self, log: Path, *flags: str):
        self.port, self.worker_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        super().__init__(log, ["--listen", self.target, "--worker-listen",
                               f"127.0.0.1:{self.worker_port}", "--device", "cpu",
                               "--kv-cache-gib", self.KV_GIB, "--metrics-listen", "127.0.0.1:0",
                               "--openai-listen", "off", *flags])

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> str:
        return super().wait_ready(timeout)
