"""One node's rank processes, the rings that feed them, and the watchdog that notices deaths.

    RankSet ── ShmBroadcastRing (1 writer, G readers) ──▶ rank 0 .. rank G-1  (spawned processes)
            ◀── ShmReplyHub (one reply ring per rank) ──┘
    watchdog thread: waits on every rank's Process.sentinel; on a death it reports
    "rank R (local rank r, pid P) was killed by signal 9 (SIGKILL)" (on_failure: the worker
    turns unready), shuts both rings down (a blocked write or gather wakes at once with
    RingClosed) and kills the other ranks (they would wait forever in a collective).

`call(message)` broadcasts one command and gathers one reply per rank. A call that cannot finish
cleanly (a death, a timeout, an interruption, ranks that disagree on success) leaves the set
`dirty`: the ranks may be mid-step or stuck in a collective, so the set must be closed and a new
one spawned. Use from one thread at a time (the worker's lock); `close` and the watchdog are the
exceptions.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_objects
from typing import Callable

from worker_service.failures import FailureKind, StepFailure
from worker_service.ranks.messages import STOP, RankReply, decode_reply, encode_command
from worker_service.ranks.rank_process import RankSpec, rank_main
from worker_service.ranks.shm_reply import ShmReplyHub
from worker_service.ranks.shm_ring import RingClosed, RingTimeout, ShmBroadcastRing

log = logging.getLogger(__name__)

_WAIT_SLICE_S = 0.05     # a gather blocks on one rank at most this long between checks
_ERROR_GRACE_S = 2.0     # after one rank's error, how long the others may take to reply too


@dataclass(frozen=True)
class RankSetOptions:
    """Ring geometry and timeouts of a rank set (sizes in bytes, times in seconds)."""

    ring_slots: int = 8
    ring_slot_bytes: int = 1 << 20
    reply_slots: int = 4
    reply_slot_bytes: int = 1 << 20
    poll_s: float = 1.0            # ranks check their parent this often while idle
    stop_timeout_s: float = 5.0    # a clean stop waits this long before killing
    # The largest command: a step's diff as the worker may receive it plus its header
    # (serve_worker sets it from --max-message-mib, which goes to 2047 MiB: the ring's own
    # default of 1 GiB refused a legal larger diff as an INTERNAL PayloadTooLarge).
    max_message_bytes: int = 1 << 30


def command_ring(num_ranks: int, options: RankSetOptions) -> ShmBroadcastRing:
    """The ring that broadcasts every command (a step's diff) to the node's ranks."""
    return ShmBroadcastRing.create(num_ranks, options.ring_slots, options.ring_slot_bytes,
                                   max_message_bytes=options.max_message_bytes)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RankSet:
    """G spawned rank processes of one node; see the module docstring."""

    def __init__(self, specs: list[RankSpec], ring: ShmBroadcastRing, hub: ShmReplyHub,
                 options: RankSetOptions, on_failure: Callable[[str], None]):
        self.specs = specs
        self.options = options
        self.failure: str | None = None
        self.dirty = False
        self._ring, self._hub = ring, hub
        self._on_failure = on_failure
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()
        ctx = mp.get_context("spawn")
        self._procs = [ctx.Process(target=rank_main, args=(spec,), daemon=True,
                                   name=f"deltaserve-rank{spec.global_rank}") for spec in specs]
        for proc in self._procs:
            proc.start()
        log.info("spawned ranks %s (pids %s)", [s.global_rank for s in specs], self.pids)
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="rank-watchdog")
        self._watchdog.start()

    @classmethod
    def spawn(cls, make_spec: Callable[..., RankSpec], num_ranks: int,
              options: RankSetOptions, on_failure: Callable[[str], None]) -> RankSet:
        """Create the rings, then `make_spec(local_rank, command_ring, reply_ring)` per rank."""
        ring = command_ring(num_ranks, options)
        hub = ShmReplyHub.create(num_ranks, options.reply_slots, options.reply_slot_bytes)
        specs = [make_spec(r, ring.handle, hub.handles[r]) for r in range(num_ranks)]
        return cls(specs, ring, hub, options, on_failure)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self.dirty and not self._closing

    # -- calls ----------------------------------------------------------------------------------

    def call(self, message: bytes, timeout: float,
             abort: threading.Event | None = None) -> list[RankReply | None]:
        """Broadcast `message`; one reply per rank, in local-rank order. When a rank reports an
        error the others get a short grace; those that still have not replied are None."""
        if not self.healthy:
            raise StepFailure(FailureKind.RANK_FAILED, self.failure or
                              "the ranks are out of step after an earlier failure; Init again")
        deadline = time.monotonic() + timeout
        try:
            self._ring.write(message, timeout=timeout)
            return self._gather(deadline, timeout, abort)
        except RingClosed:
            raise StepFailure(FailureKind.RANK_FAILED,
                              self.failure or "the rank rings were shut down") from None
        except RingTimeout as e:
            self.dirty = True
            raise StepFailure(FailureKind.RANK_FAILED,
                              f"local ranks {list(e.stalled)} did not take a message within "
                              f"{timeout:g} s") from None

    def _gather(self, deadline: float, timeout: float,
                abort: threading.Event | None) -> list[RankReply | None]:
        replies: list[RankReply | None] = [None] * len(self._procs)
        while True:
            for r, reply in enumerate(replies):
                if reply is None:
                    replies[r] = self._read(r, 0.0)
            pending = [r for r, reply in enumerate(replies) if reply is None]
            if not pending:
                return replies
            if any(reply is not None and not reply.ok for reply in replies):
                deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
            left = deadline - time.monotonic()
            if abort is not None and abort.is_set():
                self.dirty = True
                raise StepFailure(FailureKind.SUPERSEDED, "interrupted by a new Init or Reset")
            if left <= 0:
                self.dirty = True
                if any(reply is not None and not reply.ok for reply in replies):
                    return replies       # someone failed; the rest are stuck behind it
                raise StepFailure(FailureKind.RANK_FAILED,
                                  f"no reply from local ranks {pending} within {timeout:g} s")
            replies[pending[0]] = self._read(pending[0], min(_WAIT_SLICE_S, left))

    def _read(self, rank: int, timeout: float) -> RankReply | None:
        try:
            return decode_reply(self._hub.read(rank, timeout))
        except RingTimeout:
            return None

    # -- liveness -------------------------------------------------------------------------------

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while True:
            ready = wait_for_objects([*sentinels, self._wake_r])
            if self._closing:
                return
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:
                break
        local = dead[0]
        proc, spec = self._procs[local], self.specs[local]
        proc.join(1.0)  # reap it, so its exit code is known
        self.failure = (f"rank {spec.global_rank} (local rank {local}, pid {proc.pid}) "
                        f"{describe_exit(proc.exitcode)}")
        log.error("%s; stopping the other ranks", self.failure)
        self._on_failure(self.failure)  # unready before any waiting step is woken
        self._ring.shutdown()
        self._hub.shutdown()
        self._kill_all(grace_s=0.0)

    def _kill_all(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)

    def close(self) -> None:
        """Stop the ranks (cleanly when they are in step, else killed) and free the rings."""
        if self._closing:
            return
        clean = self.healthy
        self._closing = True
        os.write(self._wake_w, b"x")
        if clean:
            try:
                self._ring.write(encode_command(STOP), timeout=1.0)
            except (RingClosed, RingTimeout):
                clean = False
        self._kill_all(grace_s=self.options.stop_timeout_s if clean else 0.0)
        self._watchdog.join(5.0)
        self._ring.close()
        self._ring.unlink()
        self._hub.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
