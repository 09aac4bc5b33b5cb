"""The shared-memory broadcast ring and reply hub, with real spawned reader processes."""
from __future__ import annotations

import glob
import os
import random
import signal
import threading

import pytest

from engine_common.request.params import ParamError
from tests.support.shm_readers import SPAWN, STATS, Readers, digest
from worker_service.ranks.shm_ring import (SHM_PREFIX, PayloadTooLarge, RingClosed, RingError,
                                           RingHandle, RingTimeout, ShmBroadcastRing)


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Every test leaves /dev/shm as it found it: the segments this process made (their names
    carry its pid; other processes on the machine may be making and freeing their own)."""
    ours = f"/dev/shm/{SHM_PREFIX}{os.getpid()}_*"
    before = set(glob.glob(ours))
    yield
    leaked = set(glob.glob(ours)) - before
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"


def _payloads(slot_bytes: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [0, 1, slot_bytes - 1, slot_bytes, slot_bytes + 1, 3 * slot_bytes + 5, 0]
    sizes += [rng.randrange(0, 2 * slot_bytes) for _ in range(40)]
    return [rng.randbytes(n) for n in sizes]


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_readers", [1, 2, 3, 4])
def test_every_reader_gets_every_message_in_order(num_readers):
    msgs = _payloads(4096, seed=num_readers)
    readers = Readers(num_readers, "digest", reply_slots=len(msgs) + 1)
    try:
        for m in msgs:
            readers.ring.write(m, timeout=30)
        got = [[readers.hub.read(r, timeout=30) for _ in msgs] for r in range(num_readers)]
    finally:
        names = readers.names()
        readers.stop()
    assert got == [[digest(m) for m in msgs]] * num_readers
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)


def test_slow_reader_makes_writer_wait_and_nothing_is_overwritten():
    gate = SPAWN.Event()
    msgs = [bytes([i]) * (100 + i) for i in range(6)]
    readers = Readers(1, "digest", num_slots=2, slot_bytes=1024, reply_slots=8, gates=[gate])
    ring = readers.ring
    try:
        for m in msgs[:3]:                 # slots 0, 1, then slot 0 again once message 0 is read
            ring.write(m, timeout=30)
        assert readers.hub.read(0, timeout=30) == digest(msgs[0])
        with pytest.raises(RingTimeout) as err:      # messages 1 and 2 unread: the ring is full
            ring.write(msgs[3], timeout=0.3)
        assert err.value.stalled == (0,)
        assert ring.pending_readers() == [0]
        released = threading.Event()      # set just before the reader may go on

        def release() -> None:
            released.set()
            gate.set()

        threading.Timer(0.1, release).start()
        ring.write(msgs[3], timeout=30)   # a retry after a clean timeout is allowed
        assert released.is_set(), "the writer did not wait for the reader"
        for m in msgs[4:]:
            ring.write(m, timeout=30)
        got = [readers.hub.read(0, timeout=30) for _ in msgs[1:]]
    finally:
        readers.stop()
    assert got == [digest(m) for m in msgs[1:]]


def test_dead_reader_fails_the_writer_promptly():
    readers = Readers(2, "ack", num_slots=2, slot_bytes=256, reply_slots=8)
    ring = readers.ring
    try:
        os.kill(readers.procs[1].pid, signal.SIGKILL)
        readers.procs[1].join(30)
        ring.write(b"a")
        ring.write(b"b")                  # the two free slots
        with pytest.raises(RingTimeout) as err:    # its own timeout, naming the dead reader
            ring.write(b"c", timeout=0.5)
        assert err.value.stalled == (1,) and "[1]" in str(err.value)
        assert ring.pending_readers() == [1]
        with pytest.raises(RingTimeout) as err:       # rank 0 acked, rank 1 never will
            readers.hub.gather(timeout=0.5)
        assert err.value.stalled == (1,)
    finally:
        readers.stop()
    assert readers.procs[0].exitcode == 0


def test_shutdown_wakes_an_idle_reader_after_draining():
    with ShmBroadcastRing.create(1, num_slots=2, slot_bytes=64) as ring:
        reader = ShmBroadcastRing.attach(ring.handle, 0)
        with pytest.raises(RingTimeout):
            reader.read(timeout=0.05)
        ring.write(b"last")
        ring.shutdown()
        assert reader.read(timeout=1) == b"last"          # published data still arrives
        with pytest.raises(RingClosed):
            reader.read(timeout=1)
        with pytest.raises(RingClosed):
            ring.write(b"more")
        reader.close()


def test_shutdown_from_another_thread_unblocks_a_waiting_reader():
    with ShmBroadcastRing.create(1, num_slots=2, slot_bytes=64) as ring:
        reader = ShmBroadcastRing.attach(ring.handle, 0)
        threading.Timer(0.1, ring.shutdown).start()
        with pytest.raises(RingClosed):   # not left to its timeout: that raises RingTimeout
            reader.read(timeout=30)
        reader.close()


def test_oversize_message_is_refused_and_large_ones_are_chunked():
    with ShmBroadcastRing.create(1, num_slots=2, slot_bytes=64, max_message_bytes=1000) as ring:
        reader = ShmBroadcastRing.attach(ring.handle, 0)
        with pytest.raises(PayloadTooLarge, match="1001 bytes.*max_message_bytes=1000"):
            ring.write(b"x" * 1001)
        msg = random.Random(0).randbytes(1000)       # 16 chunks through 2 slots
        got = []
        thread = threading.Thread(target=lambda: got.append(reader.read(timeout=30)))
        thread.start()
        ring.write(msg, timeout=30)
        ring.write(b"", timeout=30)
        thread.join(30)
        assert got == [msg] and reader.read(timeout=1) == b""
        reader.close()


def test_bad_geometry_roles_and_handles_are_rejected():
    with pytest.raises(ParamError, match="num_readers"):
        ShmBroadcastRing.create(0)
    with pytest.raises(ParamError, match="slot_bytes"):
        ShmBroadcastRing.create(1, slot_bytes=0)
    with ShmBroadcastRing.create(2, num_slots=2, slot_bytes=64) as ring:
        with pytest.raises(ParamError, match="reader_rank"):
            ShmBroadcastRing.attach(ring.handle, 2)
        wrong = RingHandle(ring.handle.name, 2, 2, 128)
        with pytest.raises(RingError, match="does not match"):
            ShmBroadcastRing.attach(wrong, 0)
        reader = ShmBroadcastRing.attach(ring.handle, 1)
        with pytest.raises(RingError, match="cannot act as the writer"):
            reader.write(b"x")
        with pytest.raises(RingError, match="cannot act as the reader"):
            ring.read()
        reader.close()


def test_a_stream_of_messages_reaches_both_readers_whole():
    """Back-to-back writes, some larger than a slot: each reader counts every message and byte."""
    readers = Readers(2, "count", num_slots=8, slot_bytes=64 << 10)
    num_msgs, size = 400, 100 << 10
    try:
        msg = os.urandom(size)
        for _ in range(num_msgs):
            readers.ring.write(msg, timeout=30)
        readers.ring.shutdown()
        stats = [STATS.unpack(b) for b in readers.hub.gather(timeout=60)]
    finally:
        readers.stop()
    assert [s[:2] for s in stats] == [(num_msgs, num_msgs * size)] * 2
