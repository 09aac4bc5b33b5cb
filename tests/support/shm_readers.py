"""Spawned reader processes of the shared-memory ring for its tests. The children import this
module, not the test module: spawn then skips importing pytest in each of them."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import struct
import time

from worker_service.ranks.shm_reply import ShmReplyHub
from worker_service.ranks.shm_ring import RingClosed, RingHandle, ShmBroadcastRing

SPAWN = mp.get_context("spawn")
STATS = struct.Struct("<QQd")        # messages, bytes, idle CPU fraction


def reader_main(handle: RingHandle, rank: int, reply_handle: RingHandle, mode: str,
                gate=None) -> None:
    """Read until RingClosed. mode "digest": reply sha256+len per message; "ack": empty reply per
    message; "count": reply once at the end with STATS. With a gate, pause after message 1."""
    ring = ShmBroadcastRing.attach(handle, rank)
    reply = ShmBroadcastRing.attach_writer(reply_handle)
    reply.write(b"ready")
    count = total = 0
    idle_cpu = 0.0
    try:
        while True:
            if mode == "count" and count == 0:
                wall, cpu = time.monotonic(), time.process_time()
                msg = ring.read(timeout=30)
                idle_cpu = (time.process_time() - cpu) / max(time.monotonic() - wall, 1e-9)
            else:
                msg = ring.read(timeout=30)
            count, total = count + 1, total + len(msg)
            if mode == "digest":
                reply.write(digest(msg))
            elif mode == "ack":
                reply.write(b"")
            if gate is not None and count == 1:
                gate.wait(30)
    except RingClosed:
        pass
    finally:
        if mode == "count":
            reply.write(STATS.pack(count, total, idle_cpu))
        reply.close()
        ring.close()


def digest(msg: bytes) -> bytes:
    return hashlib.sha256(msg).digest() + len(msg).to_bytes(8, "little")


class Readers:
    """A ring, its reply hub and num_readers spawned reader processes; cleans up everything."""

    def __init__(self, num_readers, mode, num_slots=4, slot_bytes=4096, reply_slots=4,
                 gates=None, **ring_kw):
        self.ring = ShmBroadcastRing.create(num_readers, num_slots, slot_bytes, **ring_kw)
        self.hub = ShmReplyHub.create(num_readers, num_slots=reply_slots, slot_bytes=256)
        self.procs = [SPAWN.Process(target=reader_main, daemon=True,
                                    args=(self.ring.handle, r, self.hub.handles[r], mode,
                                          None if gates is None else gates[r]))
                      for r in range(num_readers)]
        for p in self.procs:
            p.start()
        assert self.hub.gather(timeout=60) == [b"ready"] * num_readers

    def names(self) -> list[str]:
        return [self.ring.handle.name] + [h.name for h in self.hub.handles]

    def stop(self) -> None:
        self.ring.shutdown()
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        self.ring.close()
        self.ring.unlink()
        self.hub.close()
