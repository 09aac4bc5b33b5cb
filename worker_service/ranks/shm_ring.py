"""In-node shared-memory broadcast ring: one writer, N readers, fixed slots, raw bytes (no pickle).

The worker service writes each step's diff once; every local rank process reads it. One POSIX
shared-memory segment, little-endian, every region 64-byte aligned:

    0             64                 64 + stride                64 + (S-1) * stride
    ┌─────────────┬──────────────────┬──────────────────┬─────┬──────────────────┐
    │ ring header │ slot 0           │ slot 1           │ ... │ slot S-1         │
    └─────────────┴──────────────────┴──────────────────┴─────┴──────────────────┘
    ring header: magic u32 │ version u32 │ num_readers u32 │ num_slots u32 │ slot_bytes u64 │
                 closed u8 │ pad to 64
    slot:        ┌─────────┬────────────┬─────────┬────────────────┬─────┬──────────────────┐
                 │ seq u64 │ length u64 │ more u8 │ read[R] u8 ... │ pad │ payload          │
                 └─────────┴────────────┴─────────┴────────────────┴─────┴──────────────────┘
                 |<-------- slot header: align64(17 + R) bytes -------->|<-- slot_bytes -->|
    seq     1 + the number of the chunk held (0: never written); the "written" flag.
    length  payload bytes used in this slot (<= slot_bytes).
    more    1 when the message goes on in the next chunk: a message longer than slot_bytes is
            split over consecutive chunks (up to max_message_bytes), so any size streams through.
    read[r] 1 once reader r has copied the chunk out. All start at 1; the writer reuses a slot
            only when every read[r] is 1 (backpressure), so unread data is never overwritten.
    Chunk n lives in slot n % S.  closed: set by close()/shutdown(); waiters raise RingClosed.

Protocol. Writer, chunk n: wait until read[*] == 1; fence; read[*] = 0; payload, length, more;
fence; seq = n + 1 (last). Reader r, chunk n: wait until seq == n + 1; fence; copy payload;
fence; read[r] = 1. shutdown(): fence; closed = 1. A reader that sees closed still drains every
chunk published before it. A dead reader leaves its read[r] at 0: the writer's bounded wait
then raises RingTimeout naming it. Hygiene: the creating end unlink()s the name; a crashed owner's
segment is removed by multiprocessing's resource tracker (spawned ranks share it).
Memory ordering: every field has one writer at a time. We rely on (1) aligned single-byte and
8-byte stores not being torn in a way that can fake the awaited value (seq is written after the
payload, so seeing all its new bytes means the payload came first), and (2) `_fence()`: a
release then an acquire of a private lock, i.e. two atomic read-modify-writes. On x86 (TSO) plain
stores/loads already keep program order and each RMW is a full barrier; on ARMv8 a store-release
followed by a load-acquire is not reordered (RCsc), so accesses before the fence are visible
before accesses after it.
"""
from __future__ import annotations

import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory

from engine_common.request.params import ParamError

_MAGIC = 0x44535247                           # "DSRG"
_VERSION = 1
_ALIGN = 64
_RING_HEADER = struct.Struct("<IIIIQ")        # magic, version, num_readers, num_slots, slot_bytes
_CLOSED_OFF = _RING_HEADER.size               # closed u8
_SEQ = struct.Struct("<Q")                    # at slot offset 0
_LEN_MORE = struct.Struct("<QB")              # at slot offset 8
_READ_OFF = 17                                # read[0] within a slot header
_MIN_SLEEP_S = 1e-5
SHM_PREFIX = "dsring_"
DEFAULT_WRITE_TIMEOUT_S = 60.0


class RingError(RuntimeError):
    """The ring cannot be used as asked (wrong role, corrupt header, broken by a timeout)."""


class RingTimeout(RingError):
    """A bounded wait ran out. `stalled`: the reader (or reply) ranks that made no progress."""

    def __init__(self, message: str, stalled: tuple[int, ...] = ()):
        super().__init__(message)
        self.stalled = tuple(stalled)


class RingClosed(RingError):
    """The ring was closed or shut down; no more messages will come."""


class PayloadTooLarge(RingError, ValueError):
    """A message is longer than the ring's max_message_bytes."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class RingHandle:
    """What a process needs to attach: segment name and geometry. Plain fields, so it pickles
    (spawn) and fits any serializer (`dataclasses.asdict`, then `RingHandle(**d)`)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int

    @property
    def header_bytes(self) -> int:
        return _align(_READ_OFF + self.num_readers)

    @property
    def stride(self) -> int:
        return self.header_bytes + _align(self.slot_bytes)

    @property
    def total_bytes(self) -> int:
        return _ALIGN + self.num_slots * self.stride

    def slot_offset(self, slot: int) -> int:
        return _ALIGN + slot * self.stride


@dataclass(frozen=True)
class WaitPolicy:
    """How waiters poll: spin for `spin_s`, then sleep for `backoff_ratio` of the time waited so
    far, capped at `max_sleep_s`. The added latency stays near that fraction of the wait (plus the
    OS's ~50 us sleep slack) while a long idle wait costs only 1/max_sleep_s wake-ups a second."""

    spin_s: float = 1e-4
    backoff_ratio: float = 0.05
    max_sleep_s: float = 2e-3

    def __post_init__(self) -> None:
        if not 0 <= self.spin_s <= 1:
            raise ParamError("spin_s", self.spin_s, "in [0, 1] seconds")
        if not 0 < self.backoff_ratio <= 1:
            raise ParamError("backoff_ratio", self.backoff_ratio, "in (0, 1]")
        if not _MIN_SLEEP_S <= self.max_sleep_s <= 1:
            raise ParamError("max_sleep_s", self.max_sleep_s, f"in [{_MIN_SLEEP_S}, 1] seconds")


def _make_fence():
    """A memory fence: release then re-acquire a private, held lock, i.e. two atomic RMWs (see
    the module docstring for why this orders). One per thread: never share it."""
    lock = threading.Lock()
    lock.acquire()

    def fence() -> None:
        lock.release()
        lock.acquire()
    return fence


def _check_geometry(num_readers: int, num_slots: int, slot_bytes: int) -> None:
    for name, value, lo, hi in (("num_readers", num_readers, 1, 1024),
                                ("num_slots", num_slots, 1, 1 << 16),
                                ("slot_bytes", slot_bytes, 1, 1 << 32)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ParamError(name, value, f"an int in [{lo}, {hi}]")


class ShmBroadcastRing:
    """One end of a broadcast ring: the writer, or reader `reader_rank`.

    Make one with `create` (owner + writer), `attach` (a reader) or `attach_writer` (a writer in
    another process, e.g. a rank's reply ring). The owner alone `unlink()`s the segment; every
    end `close()`s its mapping. `shutdown()` is the one call that is safe from another thread.
    """

    def __init__(self, shm: shared_memory.SharedMemory, handle: RingHandle, *,
                 reader_rank: int | None, owner: bool, max_message_bytes: int, wait: WaitPolicy):
        self.handle = handle
        self.reader_rank = reader_rank            # None: this end writes
        self.max_message_bytes = max_message_bytes
        self._shm, self._buf = shm, shm.buf
        self._owner, self._wait = owner, wait
        self._unlinked = False
        self._next = 0                            # next chunk number to write / read
        self._parts: list[bytes] = []             # reader: chunks of a message read so far
        self._broken = False
        self._fence = _make_fence()               # this thread's; shutdown() makes its own

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 4 << 20, *,
               max_message_bytes: int = 1 << 30, wait: WaitPolicy = WaitPolicy()
               ) -> ShmBroadcastRing:
        """Allocate a new segment; the caller owns it (must `close()` then `unlink()`)."""
        _check_geometry(num_readers, num_slots, slot_bytes)
        if max_message_bytes < 0:
            raise ParamError("max_message_bytes", max_message_bytes, ">= 0")
        # The owner's pid in the name: a leak names its maker; a leak check sees its own only.
        name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        handle = RingHandle(name, num_readers, num_slots, slot_bytes)
        shm = shared_memory.SharedMemory(name=name, create=True, size=handle.total_bytes)
        buf = shm.buf                             # a new segment is zero-filled: seq, closed = 0
        _RING_HEADER.pack_into(buf, 0, _MAGIC, _VERSION, num_readers, num_slots, slot_bytes)
        for slot in range(num_slots):
            off = handle.slot_offset(slot) + _READ_OFF
            buf[off:off + num_readers] = b"\x01" * num_readers
        return cls(shm, handle, reader_rank=None, owner=True,
                   max_message_bytes=max_message_bytes, wait=wait)

    @classmethod
    def attach(cls, handle: RingHandle, reader_rank: int, *, wait: WaitPolicy = WaitPolicy()
               ) -> ShmBroadcastRing:
        """Map an existing ring as reader `reader_rank` (0 <= rank < num_readers)."""
        if not 0 <= reader_rank < handle.num_readers:
            raise ParamError("reader_rank", reader_rank, f"in [0, {handle.num_readers})")
        return cls(cls._open(handle), handle, reader_rank=reader_rank, owner=False,
                   max_message_bytes=0, wait=wait)

    @classmethod
    def attach_writer(cls, handle: RingHandle, *, max_message_bytes: int = 1 << 30,
                      wait: WaitPolicy = WaitPolicy()) -> ShmBroadcastRing:
        """Map an existing, never-written ring as its (single) writer."""
        return cls(cls._open(handle), handle, reader_rank=None, owner=False,
                   max_message_bytes=max_message_bytes, wait=wait)

    @staticmethod
    def _open(handle: RingHandle) -> shared_memory.SharedMemory:
        # Spawned children share the parent's resource tracker, and it keeps names in a set: the
        # owner's unlink() unregisters the name for everyone.
        shm = shared_memory.SharedMemory(name=handle.name, create=False)
        header = _RING_HEADER.unpack_from(shm.buf, 0)
        expected = (_MAGIC, _VERSION, handle.num_readers, handle.num_slots, handle.slot_bytes)
        if header != expected:
            shm.close()
            raise RingError(f"ring {handle.name}: header {header} does not match handle "
                            f"{expected} (magic, version, num_readers, num_slots, slot_bytes)")
        return shm

    # -- writer ---------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview,
              timeout: float | None = DEFAULT_WRITE_TIMEOUT_S) -> None:
        """Publish one message to every reader. Blocks while the next slot holds unread data.

        Raises RingTimeout (naming the stalled readers) after `timeout` seconds (None: no limit),
        RingClosed after shutdown, PayloadTooLarge above max_message_bytes. A timeout in the
        middle of a multi-chunk message breaks the ring (later writes raise RingError).
        """
        self._require(writer=True)
        if self._broken:
            raise RingError(f"ring {self.handle.name} is broken: a write timed out mid-message")
        with memoryview(data) as raw, raw.cast("B") as view:
            if view.nbytes > self.max_message_bytes:
                raise PayloadTooLarge(f"message of {view.nbytes} bytes is too large: "
                                      f"max_message_bytes={self.max_message_bytes}")
            deadline = None if timeout is None else time.monotonic() + timeout
            size = self.handle.slot_bytes
            num_chunks = max(1, -(-view.nbytes // size))
            for i in range(num_chunks):
                try:
                    self._write_chunk(view[i * size:(i + 1) * size], i + 1 < num_chunks, deadline)
                except RingError:
                    self._broken = i > 0
                    raise

    def _write_chunk(self, chunk: memoryview, more: bool, deadline: float | None) -> None:
        h, buf = self.handle, self._buf
        off = h.slot_offset(self._next % h.num_slots)
        flags = slice(off + _READ_OFF, off + _READ_OFF + h.num_readers)
        all_read = b"\x01" * h.num_readers
        if not self._poll(lambda: buf[flags] == all_read, deadline, closed_first=True):
            stalled = tuple(r for r in range(h.num_readers) if buf[off + _READ_OFF + r] == 0)
            raise RingTimeout(f"ring {h.name}: readers {list(stalled)} have not read chunk "
                              f"{self._next - h.num_slots}; writer gave up", stalled)
        self._fence()                             # flags seen before the slot is overwritten
        buf[flags] = bytes(h.num_readers)
        start = off + h.header_bytes
        buf[start:start + chunk.nbytes] = chunk
        _LEN_MORE.pack_into(buf, off + 8, chunk.nbytes, int(more))
        self._fence()                             # payload visible before seq
        _SEQ.pack_into(buf, off, self._next + 1)
        self._next += 1

    def pending_readers(self) -> list[int]:
        """Readers that still have unread chunks: a watchdog's view of who is behind."""
        h = self.handle
        return [r for r in range(h.num_readers)
                if any(self._buf[h.slot_offset(s) + _READ_OFF + r] == 0
                       for s in range(h.num_slots))]

    # -- reader ---------------------------------------------------------------------------------

    def read(self, timeout: float | None = None) -> bytes:
        """Return the next message (a copy). Messages published before a shutdown are still
        delivered; after them RingClosed. RingTimeout after `timeout` seconds (None: no limit);
        a timed-out read can be retried and resumes where it stopped."""
        self._require(writer=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            chunk, more = self._read_chunk(deadline, timeout)
            self._parts.append(chunk)
            if not more:
                break
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def has_message(self) -> bool:
        """True when the next chunk is already published (a read would not wait)."""
        self._require(writer=False)
        return self._published()

    def _published(self) -> bool:
        off = self.handle.slot_offset(self._next % self.handle.num_slots)
        return _SEQ.unpack_from(self._buf, off)[0] == self._next + 1

    def _read_chunk(self, deadline: float | None, timeout: float | None) -> tuple[bytes, bool]:
        h, buf = self.handle, self._buf
        off = h.slot_offset(self._next % h.num_slots)
        if not self._poll(self._published, deadline, closed_first=False):
            raise RingTimeout(f"ring {h.name}: reader {self.reader_rank} got no chunk "
                              f"{self._next} within {timeout} s")
        self._fence()                             # seq seen before the payload is read
        length, more = _LEN_MORE.unpack_from(buf, off + 8)
        if length > h.slot_bytes:
            raise RingError(f"ring {h.name}: corrupt slot, length {length} > {h.slot_bytes}")
        start = off + h.header_bytes
        data = bytes(buf[start:start + length])
        self._fence()                             # payload copied before the slot is released
        buf[off + _READ_OFF + self.reader_rank] = 1
        self._next += 1
        return data, bool(more)

    # -- waiting, lifecycle ---------------------------------------------------------------------

    def _poll(self, ready, deadline: float | None, *, closed_first: bool) -> bool:
        """Spin, then back off, until ready(): True; False at the deadline. RingClosed once the
        ring is closed: at once for writers, for readers when nothing is left to drain."""
        start = time.monotonic()
        policy = self._wait
        while True:
            closed = self.is_closed()
            if closed:
                self._fence()                     # closed seen before the last seq (drain it)
            if ready() and not (closed and closed_first):
                return True
            if closed:
                raise RingClosed(f"ring {self.handle.name} is closed")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            waited = now - start
            if waited < policy.spin_s:
                os.sched_yield()                  # spin, but let a runnable peer have the core
                continue
            pause = min(max(waited * policy.backoff_ratio, _MIN_SLEEP_S), policy.max_sleep_s)
            time.sleep(pause if deadline is None else min(pause, deadline - now))

    def _require(self, *, writer: bool) -> None:
        if self._buf is None:
            raise RingError(f"ring {self.handle.name}: this end is closed")
        if writer != (self.reader_rank is None):
            role = "writer" if writer else "reader"
            raise RingError(f"ring {self.handle.name}: this end cannot act as the {role}")

    def is_closed(self) -> bool:
        """True once any end called shutdown() (or the writer called close())."""
        return self._buf is None or self._buf[_CLOSED_OFF] != 0

    def shutdown(self) -> None:
        """Mark the ring closed for every process: blocked writers and idle readers wake with
        RingClosed. Safe to call from a watchdog thread; does not unmap."""
        if self._buf is not None:
            _make_fence()()                       # messages written so far precede the flag
            self._buf[_CLOSED_OFF] = 1

    def close(self) -> None:
        """Unmap this end (idempotent). A writer first marks the ring closed."""
        if self._buf is None:
            return
        if self.reader_rank is None:
            self.shutdown()
        self._buf = None
        self._shm.close()

    def unlink(self) -> None:
        """Owner only: remove the segment name from /dev/shm (idempotent)."""
        if not self._owner:
            raise RingError(f"ring {self.handle.name}: only the creating end may unlink")
        if self._unlinked:
            return
        self._unlinked = True
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> ShmBroadcastRing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self._owner:
            self.unlink()
