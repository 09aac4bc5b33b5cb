"""Rank -> worker replies: one single-reader `ShmBroadcastRing` per rank, owned by the worker.

Every step each rank writes exactly one reply on its own ring: the output rank its sampled-ids
bytes, the other ranks an empty ack (or, with symmetry checks, a digest). The worker gathers one
reply per rank, so it knows the step finished everywhere, and a rank that stops replying is named
in the RingTimeout instead of hanging the Step stream.

    worker (owns segments)                       rank r (spawned process)
    ShmReplyHub.create(G) ── handles[r] ──spawn──▶ reply = ShmBroadcastRing.attach_writer(h)
    hub.gather(timeout) ◀── reply ring r ───────── reply.write(ids_bytes or b"")
"""
from __future__ import annotations

import time

from worker_service.ranks.shm_ring import RingHandle, RingTimeout, ShmBroadcastRing, WaitPolicy


class ShmReplyHub:
    """The worker's end of G reply rings: it owns them and reads them; rank r writes ring r."""

    def __init__(self, owners: list[ShmBroadcastRing], readers: list[ShmBroadcastRing]):
        self._owners = owners
        self._readers = readers

    @classmethod
    def create(cls, num_ranks: int, num_slots: int = 4, slot_bytes: int = 1 << 20, *,
               wait: WaitPolicy = WaitPolicy()) -> ShmReplyHub:
        """Allocate one reply ring per rank; close() releases and unlinks them all."""
        owners: list[ShmBroadcastRing] = []
        try:
            for _ in range(num_ranks):
                owners.append(ShmBroadcastRing.create(1, num_slots, slot_bytes, wait=wait))
            readers = [ShmBroadcastRing.attach(o.handle, 0, wait=wait) for o in owners]
        except BaseException:
            for ring in owners:
                ring.close()
                ring.unlink()
            raise
        return cls(owners, readers)

    @property
    def handles(self) -> list[RingHandle]:
        """handles[r] goes to rank r, which attaches it with ShmBroadcastRing.attach_writer."""
        return [ring.handle for ring in self._owners]

    @property
    def num_ranks(self) -> int:
        return len(self._owners)

    def read(self, rank: int, timeout: float | None = None) -> bytes:
        """The next reply of one rank."""
        return self._readers[rank].read(timeout)

    def gather(self, timeout: float | None = None) -> list[bytes]:
        """One reply from every rank, in rank order. RingTimeout names the ranks with no reply
        (replies already taken from the others are dropped: the step is failed anyway)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        replies = []
        for rank, reader in enumerate(self._readers):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                replies.append(reader.read(left))
            except RingTimeout:
                stalled = tuple(r for r in range(rank, self.num_ranks)
                                if not self._readers[r].has_message())
                raise RingTimeout(f"no step reply from ranks {list(stalled)} within "
                                  f"{timeout} s", stalled) from None
        return replies

    def shutdown(self) -> None:
        """Close every reply ring for all processes (wakes blocked gathers and rank writers)."""
        for ring in self._owners:
            ring.shutdown()

    def close(self) -> None:
        """Shut down, unmap and unlink every reply ring (idempotent)."""
        for ring in self._readers + self._owners:
            ring.close()
        for ring in self._owners:
            ring.unlink()
