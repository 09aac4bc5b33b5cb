"""How long a Generate stream may wait for its client to read (--stream-send-timeout).

The engine never waits for a stream's reader: a client that stops reading leaves its request
running and its output waiting, first in grpc's buffers (the HTTP/2 windows and the sockets',
up to a few MB, where `context.write` returns at once), then in its stream's mailbox while
the handler's write waits for the client. Before (session 45, measured), that output stayed
until the client read it or the call ended: about 3.2 MB a stream of 2,000 tokens with 20
logprobs, bounded only by --max-requests-per-key.

So every write of a stream's message waits at most `timeout_s` for the client to take it, as
nginx's `send_timeout` bounds the time between two successive writes to a client: a write
still waiting then is cancelled, the handler raises StalledClient, and the engine's stream is
closed as for any early end (the request aborted, its KV blocks freed at once, its mailbox
dropped); the call ends RESOURCE_EXHAUSTED naming the flag, which the client reads after the
messages grpc still holds for it. A client that keeps reading lets each write through: a
lagging reader's backlog is sent as messages of at most MAX_MERGED_STEPS steps
(stream_hub.py), so a write waits for at most one such message to pass the client's window;
only a client that takes less than that in `timeout_s` (for 64 steps of a token with 20
logprobs, some 20 KB: under 400 bytes a second at 60 s) is cut. A message larger than
WINDOW_BYTES (a non-streamed VllmEngine answer, a first message carrying a long prompt's
logprobs) gets `timeout_s` per WINDOW_BYTES of it: grpc passes it to the client a window at a
time, and a client on a slow link that keeps taking it is not cut because its answer is one
message (a 5 MB answer taken at 64 KB/s needs 80 s: before, it was cut at 60). No cap on the
output waiting: it is the request's own output (max_tokens bounds it), and a cap would cut a
slow reader of a long answer, whose backlog grows while it reads. The time is the injected
`clock`'s, read at each write and at each tick (every `tick_s` of the event loop while a write
waits)."""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Callable

from scheduler_service.errors import StalledClient

DEFAULT_SEND_TIMEOUT_S = 60.0      # nginx's send_timeout
# A write may wait `timeout_s` per this many bytes of its message (HTTP/2's initial window):
# a client is cut when it takes less than one window of a message in `timeout_s`.
WINDOW_BYTES = 64 * 1024


@dataclass(slots=True)
class _Write:
    """A write in progress: when it began, its message, and how long it may wait (computed
    once it has waited `timeout_s`: the message's size is read only for the rare slow write)."""
    start: float
    message: object
    allowed_s: float | None = None


class SendWatch:
    """The writes in progress of the port's streams, each cancelled once it has waited
    `timeout_s` (0: never). Used from the event loop only. `on_stall()` runs once per stream
    cut (the metrics count it)."""

    def __init__(self, timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, tick_s: float | None = None,
                 on_stall: Callable[[], object] | None = None):
        self.timeout_s = timeout_s
        self._clock = clock
        self._tick_s = tick_s if tick_s is not None else min(max(timeout_s / 8, 0.05), 1.0)
        self._on_stall = on_stall
        # the handler task of each write in progress -> the write
        self._writes: dict[asyncio.Task, _Write] = {}
        self._stalled: set[asyncio.Task] = set()         # those `check` cancelled
        self._ticker: asyncio.TimerHandle | None = None
        # writes begun, sent, streams cut, and checks made: tests watch them
        self.num_started = 0
        self.num_sent = 0
        self.num_stalled = 0
        self.num_checks = 0

    @property
    def num_waiting(self) -> int:
        """Writes in progress."""
        return len(self._writes)

    async def write(self, context, message, first: bool = False) -> None:
        """`context.write(message)`, or StalledClient when it waits `timeout_s`. `first`: the
        stream's first message: its headers go first, on their own (not flow-controlled), so
        that a status can follow a write that never ends (grpc refuses to send the headers
        again with the status while the first message's batch is pending). Timed in the
        handler's own task (`check` cancels it): no task per message."""
        if not self.timeout_s:
            await context.write(message)
            return
        task = asyncio.current_task()
        self._writes[task] = write = _Write(self._clock(), message)
        self.num_started += 1
        self._arm()
        try:
            if first:
                await context.send_initial_metadata(())
            await context.write(message)
            self.num_sent += 1
        except asyncio.CancelledError:
            if task not in self._stalled:
                raise                    # the call was cancelled: not ours
            task.uncancel()
            self.num_stalled += 1
            if self._on_stall is not None:
                self._on_stall()
            raise StalledClient(self._why(write.allowed_s)) from None
        finally:
            self._writes.pop(task, None)
            self._stalled.discard(task)

    def check(self) -> None:
        """Cancel each write that has waited its allowance by the clock (its handler's task):
        `timeout_s`, per WINDOW_BYTES of a larger message."""
        now = self._clock()
        self.num_checks += 1
        for task, write in list(self._writes.items()):
            if now - write.start < self.timeout_s or task in self._stalled:
                continue
            if write.allowed_s is None:
                windows = math.ceil(write.message.ByteSize() / WINDOW_BYTES)
                write.allowed_s = self.timeout_s * max(1, windows)
            if now - write.start >= write.allowed_s:
                self._stalled.add(task)
                task.cancel()

    def _why(self, allowed_s: float) -> str:
        waited = (f"the client read none of this stream's output for {self.timeout_s:g} s "
                  "while it waited" if allowed_s == self.timeout_s else
                  f"one message of this stream waited {allowed_s:g} s for the client (the "
                  f"timeout per {WINDOW_BYTES // 1024} KiB of it)")
        return (f"stream_send_timeout={self.timeout_s:g} s is exceeded: {waited} "
                "(--stream-send-timeout); the request was aborted and its KV blocks freed")

    def _arm(self) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().call_later(self._tick_s, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        self.check()
        if self._writes:
            self._arm()


def send_watch(options, engine) -> SendWatch:
    """The port's watch for ApiOptions `options` (--stream-send-timeout), counting each cut
    stream in the engine's counters (the `deltaserve:streams_stalled` metric; none without
    an engine: a servicer built only to convert messages)."""
    counters = getattr(engine, "counters", None)
    return SendWatch(options.stream_send_timeout_s,
                     on_stall=None if counters is None else counters.stalled)
