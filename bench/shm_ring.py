"""Shared-memory broadcast ring microbenchmark: throughput to 2 reader processes and round trip.

    python -m bench.shm_ring

Prints messages/s and MB/s for 1 KB and 1 MB messages, the readers' CPU use while idle, and the
round trip of a 4-byte write answered by both readers (median and p90). Correctness is tested
in tests/unit/worker_service/ranks/test_shm_ring.py; this only measures.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import struct
import time

from worker_service.ranks.shm_reply import ShmReplyHub
from worker_service.ranks.shm_ring import RingClosed, RingHandle, ShmBroadcastRing

_STATS = struct.Struct("<QQd")        # messages, bytes, idle CPU fraction
_SPAWN = mp.get_context("spawn")


def _reader(handle: RingHandle, rank: int, reply_handle: RingHandle, ack: bool) -> None:
    """Read until RingClosed; ack each message, or report _STATS once at the end."""
    ring = ShmBroadcastRing.attach(handle, rank)
    reply = ShmBroadcastRing.attach_writer(reply_handle)
    reply.write(b"ready")
    count = total = 0
    wall, cpu = time.monotonic(), time.process_time()
    idle_cpu = None
    try:
        while True:
            msg = ring.read(timeout=60)
            if idle_cpu is None:
                idle_cpu = (time.process_time() - cpu) / max(time.monotonic() - wall, 1e-9)
            count, total = count + 1, total + len(msg)
            if ack:
                reply.write(b"")
    except RingClosed:
        pass
    finally:
        if not ack:
            reply.write(_STATS.pack(count, total, idle_cpu or 0.0))
        reply.close()
        ring.close()


class _Readers:
    def __init__(self, ack: bool, slot_bytes: int = 4 << 20):
        self.ring = ShmBroadcastRing.create(2, 8, slot_bytes)
        self.hub = ShmReplyHub.create(2, num_slots=8, slot_bytes=256)
        self.procs = [_SPAWN.Process(target=_reader, daemon=True,
                                     args=(self.ring.handle, r, self.hub.handles[r], ack))
                      for r in range(2)]
        for p in self.procs:
            p.start()
        self.hub.gather(timeout=60)

    def stop(self) -> None:
        self.ring.shutdown()
        for p in self.procs:
            p.join(30)
        self.ring.close()
        self.ring.unlink()
        self.hub.close()


def throughput(num_msgs: int, size: int) -> tuple[float, float, float]:
    """(messages/s, MB/s, the readers' idle CPU fraction) with 2 readers."""
    readers = _Readers(ack=False)
    try:
        time.sleep(1.0)                   # the readers idle meanwhile: their CPU use is measured
        msg = os.urandom(size)
        start = time.perf_counter()
        for _ in range(num_msgs):
            readers.ring.write(msg, timeout=30)
        readers.ring.shutdown()
        stats = [_STATS.unpack(b) for b in readers.hub.gather(timeout=60)]
        seconds = time.perf_counter() - start
    finally:
        readers.stop()
    return num_msgs / seconds, num_msgs * size / seconds / 1e6, max(s[2] for s in stats)


def round_trips(n: int = 300) -> list[float]:
    """Seconds from a 4-byte write to both readers' acks, sorted."""
    readers = _Readers(ack=True)
    try:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            readers.ring.write(b"ping")
            readers.hub.gather(timeout=30)
            times.append(time.perf_counter() - start)
    finally:
        readers.stop()
    return sorted(times)


def main() -> None:
    for num_msgs, size in ((5000, 1000), (300, 1 << 20)):
        rate, mbps, idle = throughput(num_msgs, size)
        print(f"2 readers, {size} B messages: {rate:,.0f} msg/s, {mbps:,.1f} MB/s; "
              f"idle reader CPU {100 * idle:.1f}%")
    rtts = round_trips()
    print(f"round trip (write + both replies), 4 B: median {1e6 * rtts[len(rtts) // 2]:.0f} us, "
          f"p90 {1e6 * rtts[len(rtts) * 9 // 10]:.0f} us")


if __name__ == "__main__":
    main()
