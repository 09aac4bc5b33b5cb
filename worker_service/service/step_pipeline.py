"""A pipelined Step stream: step t+1 is launched before step t is finished.

Used when the node worker runs one in-process rank on an asynchronous device (CUDA, or the
simulated device of the host benchmarks): NodeWorker.pipelined. A reader thread moves the
stream's requests into one queue; a watcher thread waits, without the GIL, for the held step's
device work and then puts a wake-up into the same queue. The handler takes from it in order:

    a request   launch it (NodeWorker.launch_step) and send the replies that became ready:
                the previous step's, finished right after this one was launched
    a wake-up   the held step is done on the device and no next step has come: finish it
                and send its reply
    the end     finish the held step, send its reply, end the stream

The reader takes at most MAX_READ_AHEAD requests ahead of the handler: it moved every request
into the queue as it came, which undid gRPC's flow control, so one stream could park any number
of messages of up to --max-message-mib each in the worker's memory behind a running step (a
hostile run, session 38; the non-pipelined stream reads one request at a time).

So a reply goes out as soon as its step is done or the next one is launched, whichever is first,
and while the scheduler keeps steps in flight (async scheduling: three to a node that answers
Init with `pipelined`) the device always has the next step queued. Replies keep step order. A failure is sent as the non-pipelined stream sends
it (the servicer's `refuse`), and ends the stream.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

from engine_common.wire.protos import worker_pb2
from worker_service.service.node_worker import NodeWorker

_END = object()
# Requests read from the stream and not yet taken by the handler (the scheduler keeps at most three
# steps in flight to a pipelined worker).
MAX_READ_AHEAD = 4


class _DeviceWatcher:
    """Waits for launched steps' device work, one at a time, and reports each to `events`."""

    def __init__(self, events: queue.SimpleQueue):
        self._events = events
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="step-watcher", daemon=True).start()

    def watch(self, launched) -> None:
        self._todo.put(launched)

    def close(self) -> None:
        self._todo.put(None)

    def _loop(self) -> None:
        while (launched := self._todo.get()) is not None:
            try:
                launched.wait_device()
            finally:
                self._events.put(("done", launched))


def pipelined_steps(worker: NodeWorker, stream_id: int, request_iterator,
                    refuse: Callable[[int, int, Exception], Iterator[worker_pb2.StepResponse]]
                    ) -> Iterator[worker_pb2.StepResponse]:
    """The Step stream's responses. `refuse(epoch, step, error)` yields the error response and
    aborts the call."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    room = threading.Semaphore(MAX_READ_AHEAD)     # one per request the handler may be behind
    ended = threading.Event()                      # the handler is done: the reader stops

    def read() -> None:
        try:
            requests = iter(request_iterator)
            while room.acquire() and not ended.is_set():
                req = next(requests, _END)
                if req is _END:
                    break
                events.put(req)
        except Exception:  # noqa: BLE001 - the call was cancelled or ended: end the stream
            pass
        events.put(_END)

    threading.Thread(target=read, name="step-reader", daemon=True).start()
    watcher = _DeviceWatcher(events)
    epoch = last_step = 0
    try:
        while True:
            item = events.get()
            if isinstance(item, worker_pb2.StepRequest):
                room.release()
            if item is _END or isinstance(item, tuple):
                if isinstance(item, tuple) and worker.held_step(stream_id) is not item[1]:
                    continue                        # that step was finished meanwhile
                try:
                    replies = worker.flush(stream_id)
                except Exception as e:  # noqa: BLE001 - sent as a launch failure is
                    yield from refuse(epoch, last_step, e)
                    return
                yield from _send(epoch, replies)
                if item is _END:
                    return
                continue
            epoch, last_step = item.epoch, item.step
            digest = item.digest if item.HasField("digest") else None
            try:
                replies = worker.launch_step(stream_id, item.epoch, item.step, item.payload,
                                             digest)
            except Exception as e:  # every failure is a kind: never an UNKNOWN status
                yield from refuse(item.epoch, item.step, e)
                return
            yield from _send(epoch, replies)
            held = worker.held_step(stream_id)
            if held is not None:
                watcher.watch(held)
    finally:
        ended.set()
        room.release()       # a reader waiting for room wakes and stops
        watcher.close()


def _send(epoch: int, replies) -> Iterator[worker_pb2.StepResponse]:
    for step, reply in replies:
        yield worker_pb2.StepResponse(epoch=epoch, step=step, payload=reply.payload,
                                      digest=reply.digest)
