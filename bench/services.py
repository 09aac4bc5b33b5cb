"""A worker and a scheduler as real `deltaserve` processes on loopback, for benchmarks.

    with Services(log_dir) as svc:
        svc.start(model_dir, device="cpu", scheduler_flags=["--max-num-seqs", "256"])
        ... talk to svc.target (HOST:PORT of the scheduler) ...

Both bind port 0 and are found through their ready lines: the worker prints "deltaserve worker
listening on HOST:PORT" once it accepts calls, the scheduler "DeltaServe scheduler ready on
HOST:PORT" once every worker is initialized (model loaded, KV cache allocated). Output goes to
one log file per process (never a pipe, so a chatty process cannot block on a full one). Each
child runs in its own session by default (a terminal's Ctrl-C reaches only this process), or in
this process's group with `own_session=False` (so a benchmark that counts its process group's
CPU time counts theirs too); either way it gets SIGTERM if this process dies, and `close()`
stops them, SIGKILL after a grace period.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from deltaserve.child_process import dying_with_parent

REPO_ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
WORKER_READY = re.compile(r"deltaserve worker listening on \S+:(\d+)")
SCHEDULER_READY = re.compile(r"DeltaServe scheduler ready on \S+:(\d+)")
_STOP_SECONDS = 10.0
_POLL_SECONDS = 0.05


class ServiceError(RuntimeError):
    """A service exited or did not print its ready line in time (the message has its log)."""


class Service:
    """One `python -m deltaserve.cli ...` child process and its log file."""

    def __init__(self, name: str, cli_args: list[str], log_path: Path, env: dict[str, str],
                 own_session: bool = True, repo_root: Path = REPO_ROOT):
        self.name = name
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(
                dying_with_parent([sys.executable, "-m", "deltaserve.cli", *cli_args]),
                cwd=repo_root, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=own_session)

    def wait_ready(self, pattern: re.Pattern, timeout_s: float) -> int:
        """The port in the first log line matching `pattern` (group 1)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = pattern.search(self.log_path.read_text(errors="replace"))
            if match:
                return int(match.group(1))
            if self.popen.poll() is not None:
                raise ServiceError(f"{self.name} exited with code {self.popen.returncode}"
                                   f" before it was ready:\n{self.log_tail()}")
            time.sleep(_POLL_SECONDS)
        raise ServiceError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def wait_stopped(self, timeout_s: float = _STOP_SECONDS) -> None:
        """Wait for exit after terminate(); SIGKILL if it takes longer than `timeout_s`."""
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_bytes()[-num_chars:].decode(errors="replace")


class Services:
    """One worker and one scheduler; a context manager that stops both on exit. `repo_root`:
    the checkout whose code they run (another one for before/after comparisons)."""

    def __init__(self, log_dir: str | Path, extra_env: dict[str, str] | None = None,
                 own_session: bool = True, repo_root: str | Path = REPO_ROOT):
        self.log_dir = Path(log_dir)
        self.repo_root = Path(repo_root)
        self.own_session = own_session
        self.extra_env = dict(extra_env or {})
        self.procs: list[Service] = []
        self.target = ""
        self.worker_port = 0

    def __enter__(self) -> "Services":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, model_dir: str, device: str, scheduler_flags: list[str],
              timeout_s: float = 180.0, worker_flags: tuple[str, ...] = ()) -> str:
        """Start the worker (with `worker_flags`), then the scheduler pointed at it; returns the
        scheduler's HOST:PORT once it is ready to serve. The worker's port is `worker_port`."""
        worker = self._spawn("worker", ["worker", "--listen", f"{HOST}:0", "--device", device,
                                        *worker_flags])
        worker_port = self.worker_port = worker.wait_ready(WORKER_READY, timeout_s)
        scheduler = self._spawn("scheduler", [
            "scheduler", "--model", str(model_dir), "--workers", f"{HOST}:{worker_port}",
            "--listen", f"{HOST}:0", *scheduler_flags])
        self.target = f"{HOST}:{scheduler.wait_ready(SCHEDULER_READY, timeout_s)}"
        return self.target

    def close(self) -> None:
        """Stop every child, the scheduler before the worker it talks to."""
        for proc in reversed(self.procs):
            proc.terminate()
            proc.wait_stopped()
        self.procs.clear()

    def _spawn(self, name: str, cli_args: list[str]) -> Service:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = Service(name, cli_args, self.log_dir / f"{name}.log", self._env(),
                       self.own_session, self.repo_root)
        self.procs.append(proc)
        return proc

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.repo_root),
                                                          env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        return env
