"""How long a thread of a serving process may wait for the GIL before it asks for it.

A thread that wants the GIL waits for the holder to let go, and only after `sys.getswitchinterval()`
(5 ms by default) forces a switch. A step over gRPC crosses several threads in each process: in
the scheduler the Step stream's grpc threads, its reader and the engine thread, in the worker the
server's threads, the stream's reader and the step handler. Each crossing waits for the GIL while
the scheduler's event loop, busy with the public streams' messages, holds it. At 5 ms a crossing
can cost most of a 5.8 ms device step. With 0.2 ms, `make bench-host`'s gRPC lane (128
requests, simulated 5.8 ms device, async scheduling) went from 1.63x the device time to 1.29x
(median of 5 alternating rounds on a loaded 2-core Xeon; docs/gpu.md). Threads that compute
(torch, the kernels) release the GIL, so a shorter interval costs them nothing; pure-Python
threads switch more often, a few microseconds each.
"""
from __future__ import annotations

import sys

SERVING_SWITCH_INTERVAL_S = 0.0002


def shorten_gil_switch_interval(seconds: float = SERVING_SWITCH_INTERVAL_S) -> None:
    """Set the process's GIL switch interval (call once, at a serving process's start)."""
    if not 0 < seconds <= 0.005:
        raise ValueError(f"seconds={seconds!r} is invalid: must be in (0, 0.005]")
    sys.setswitchinterval(seconds)
