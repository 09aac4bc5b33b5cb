"""The harness's side of an engine process: start it, wait for its ready line, send commands,
read replies (protocol.py), stop it.

Replies come on the child's stdout, read by a thread into a queue; its stderr (everything the
engine prints) goes to a log file, whose tail is quoted when the engine fails. The child runs in
its own session, so stopping it reaches the processes it spawned (vLLM's engine core).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path

from bench.peers.protocol import PREFIX

_STOP_SECONDS = 20.0


class EngineFailed(RuntimeError):
    """An engine process replied with an error, exited, or did not answer in time."""


class EngineProcess:
    """One engine process. `name` labels it in reports and errors."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: str | Path,
                 log_path: str | Path) -> None:
        self.name = name
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w", encoding="utf-8")
        self._replies: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, cwd=str(cwd), text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._replies.put(json.loads(line[len(PREFIX):]))
            else:
                self._log.write(line)
        self._replies.put(None)      # EOF: the process is gone

    def wait_event(self, event: str, timeout_s: float) -> dict:
        """The next reply, which must be `event`; raises EngineFailed otherwise."""
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineFailed(f"{self.name}: no {event!r} reply within {timeout_s:.0f} s"
                               f"{self.log_tail()}") from None
        if reply is None:
            raise EngineFailed(f"{self.name} exited (code {self.proc.wait()}) before its "
                               f"{event!r} reply{self.log_tail()}")
        if reply.get("event") != event:
            raise EngineFailed(f"{self.name}: {reply.get('message', reply)}{self.log_tail()}")
        return reply

    def command(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def run(self, tag: str, timeout_s: float) -> dict:
        """One timed run of the workload; the engine's "result" reply."""
        self.command(cmd="run", tag=tag)
        return self.wait_event("result", timeout_s)

    def log_tail(self, num_lines: int = 30) -> str:
        self._log.flush()
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return f"\n--- last lines of {self.log_path}:\n" + "\n".join(lines[-num_lines:])

    def close(self) -> None:
        """Ask it to quit; SIGTERM then SIGKILL its whole session if it lingers."""
        if self.proc.poll() is None:
            try:
                self.command(cmd="quit")
                self.proc.stdin.close()
                self.proc.wait(_STOP_SECONDS)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(_STOP_SECONDS)
            except (OSError, subprocess.TimeoutExpired):
                continue
        try:        # what it spawned and left behind (its session is its process group)
            os.killpg(self.proc.pid, signal.SIGTERM)
        except OSError:
            pass
        self._log.close()
