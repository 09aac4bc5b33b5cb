"""How far a long start-up step is, as lines a first run prints while it waits.

`Progress` counts a step that knows its size (weights loaded, weights packed, CUDA graphs
captured): "LABEL: 50% (136/272 tensors, 0.8 s)" at each quarter. `heartbeat` covers a step that
cannot count (a compiler, a warm-up forward): "LABEL..." as it starts, "LABEL: 20 s so far" every
`period_s` while it runs, "LABEL: done in 63.2 s" at the end. The clock, the wait between beats
and where the lines go are arguments, so tests drive them without sleeping.

As a command it runs another one under a heartbeat (the Makefile's long steps):
    python -m engine_common.runtime.progress "building CPU kernels (about 1-3 minutes)" -- CMD ARGS...
"""
from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger(__name__)

Emit = Callable[[str], None]
Clock = Callable[[], float]
# wait(stop, seconds): True once `stop` is set, False when `seconds` passed without it.
Wait = Callable[[threading.Event, float], bool]

HEARTBEAT_SECONDS = 10.0     # a step silent for longer than this looks hung to a first user


def _event_wait(stop: threading.Event, seconds: float) -> bool:
    return stop.wait(seconds)


class Progress:
    """`advance()` once per unit done; a line at each 1/`steps` of `total`, the last at 100%."""

    def __init__(self, label: str, total: int, unit: str, emit: Emit = log.info,
                 clock: Clock = time.monotonic, steps: int = 4):
        if steps < 1:
            raise ValueError(f"steps={steps} is invalid: must be >= 1")
        self.label, self.total, self.unit = label, total, unit
        self.emit, self.clock, self.steps = emit, clock, steps
        self.done = 0
        self.next_step = 1
        self.start = clock()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.total and self.done * self.steps >= self.next_step * self.total:
            self.next_step = self.done * self.steps // self.total + 1
            self.emit(f"{self.label}: {100 * self.done // self.total}% "
                      f"({self.done}/{self.total} {self.unit}, "
                      f"{self.clock() - self.start:.1f} s)")


@contextmanager
def heartbeat(label: str, period_s: float = HEARTBEAT_SECONDS, emit: Emit = log.info,
              clock: Clock = time.monotonic, wait: Wait = _event_wait) -> Iterator[None]:
    """Lines while the block runs (see the module docstring); the last one says how long it
    took, or that it failed after that long."""
    start = clock()
    emit(f"{label}...")
    stop = threading.Event()

    def beat() -> None:
        while not wait(stop, period_s):
            emit(f"{label}: {clock() - start:.0f} s so far")

    beater = threading.Thread(target=beat, name="heartbeat", daemon=True)
    beater.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        beater.join()
        emit(f"{label}: {'done' if ok else 'failed'} in {clock() - start:.1f} s")


class _Exited(Exception):
    """The command failed: the heartbeat's last line says so."""

    def __init__(self, code: int):
        super().__init__(f"exit code {code}")
        self.code = code


def _to_stdout(line: str) -> None:
    print(line, flush=True)


def run_with_heartbeat(label: str, cmd: list[str], period_s: float = HEARTBEAT_SECONDS,
                       emit: Emit = _to_stdout) -> int:
    """Run `cmd` (its output is ours) under a heartbeat; its exit code (127: it could not
    start)."""
    try:
        with heartbeat(label, period_s, emit):
            code = subprocess.run(cmd).returncode
            if code != 0:
                raise _Exited(code)
    except _Exited as e:
        emit(f"{label}: {cmd[0]} exited with code {e.code}")
        return e.code
    except OSError as e:
        emit(f"{label}: cannot run {cmd[0]!r}: {e}")
        return 127
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m engine_common.runtime.progress LABEL -- CMD [ARGS...]", file=sys.stderr)
        return 2
    return run_with_heartbeat(argv[0], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
