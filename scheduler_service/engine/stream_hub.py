"""The serving side of AsyncEngine on one event loop: text, stop strings and the streams' mailboxes.

The engine thread hands a hub one list per loop turn (`deliver`, scheduled with a single
`call_soon_threadsafe`): every TokenUpdate of the step for this loop's requests, and StreamError
for requests that ended without one (rejected, engine failure). The hub turns the updates into
RequestOutputs with its own OutputProcessor and puts each in its stream's Mailbox; requests that
matched a stop string (or whose output failed) go back to the engine in one `finish` command.

NOTE ordering: items of one request arrive in engine order (a loop runs its callbacks FIFO), and
nothing follows a request's final item. After a stop string matched, the engine may still send
that request's tokens of the next step or two (it learns of the match late); the processor no
longer tracks the request and drops them. Every method runs on `loop`.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from scheduler_service.core.admission import RequestRejected
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.engine.metrics import SchedulerMetrics
from scheduler_service.engine.output_processor import OutputProcessor, RequestOutput
from scheduler_service.engine.request_output import merge_run
from scheduler_service.engine.serving_counters import ServingCounters
from scheduler_service.core.step_result import TokenUpdate


@dataclass(frozen=True)
class StreamError:
    """The stream of `request_id` ends with `error` (never added, or the engine failed)."""

    request_id: str
    error: BaseException


class Mailbox:
    """One stream's items (outputs, or the error that ends it) in order; its one consumer takes
    everything waiting at once. Leaner than an asyncio.Queue (no size bound, no task counting):
    the hub puts an item per stream per step, and the consumer merges what piled up. Loop only."""

    __slots__ = ("_loop", "_items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take_nowait(self) -> list:
        """Every item waiting, oldest first (empty if none)."""
        items, self._items = self._items, []
        return items

    async def take(self) -> list:
        """Every item waiting, oldest first; waits for one if none is."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.take_nowait()


# finish(request_ids, status): ask the engine to finish requests the serving side ended.
FinishCommand = Callable[[list[str], RequestStatus], None]


class StreamHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, processor: OutputProcessor,
                 finish: FinishCommand, counters: ServingCounters, metrics: SchedulerMetrics):
        self.loop = loop
        self._processor = processor
        self._finish = finish
        self._counters = counters
        self._metrics = metrics
        self._boxes: dict[str, Mailbox] = {}
        # The request each open box is for: an id is unique among unfinished requests only,
        # so a late update of a finished request may name the id of a newer stream.
        self._opened: dict[str, Request] = {}

    def open(self, request: Request) -> Mailbox:
        """The mailbox the request's outputs (or its error) will arrive in."""
        rid = request.request_id
        if rid in self._boxes:
            raise RequestRejected(rid, "request_id", rid, "unique among unfinished requests")
        self._processor.add_request(request)
        self._boxes[rid] = box = Mailbox(self.loop)
        self._opened[rid] = request
        return box

    def deliver(self, items: list) -> None:
        """One hand-off from the engine thread: TokenUpdates and StreamErrors."""
        start = time.perf_counter()
        # A stop string ends a stream here before the engine hears of it; its client may open
        # a new stream with the same id meanwhile. The old request's late updates are not its.
        opened = self._opened.get
        updates = [item for item in items if isinstance(item, TokenUpdate)
                   and (item.request is None or opened(item.request_id) is item.request)]
        outputs, stopped_ids = self._processor.process(updates)
        processing_s = time.perf_counter() - start
        failed_ids = [out.request_id for out in outputs if out.error is not None]
        for out in outputs:
            self._put(out.request_id, out if out.error is None else out.error, out.finished)
        for item in items:
            if isinstance(item, StreamError):
                self._processor.drop(item.request_id)
                self._metrics.forget(item.request_id)
                self._put(item.request_id, item.error, True)
        if stopped_ids:
            self._finish(stopped_ids, RequestStatus.FINISHED_STOP_STRING)
        if failed_ids:
            self._finish(failed_ids, RequestStatus.FINISHED_ABORTED)
        self._counters.record(outputs)
        self._metrics.observe_outputs(outputs, processing_s)

    def _put(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        if last:
            self._opened.pop(request_id, None)
        box = self._boxes.pop(request_id, None) if last else self._boxes.get(request_id)
        if box is not None:
            box.put(item)


# Outputs (engine steps) merged into one message at most (AsyncEngine.generate): a lagging
# reader's messages stay small, so each goes through its client's window in bounded time and
# a reader that keeps reading never has one write wait --stream-send-timeout (before, the whole
# backlog was one message, which grew with the lag until one write took longer than any limit).
MAX_MERGED_STEPS = 64


def coalesce(items: list, max_run: int | None = None) -> list:
    """A stream's waiting items with each run of consecutive outputs merged into one (an error,
    or a finished output, ends a run: nothing follows either; so does `max_run` outputs). Each
    run is merged at once (merge_run): linear in what waited, however long the consumer
    lagged."""
    if len(items) == 1:
        return items
    out: list = []
    run: list[RequestOutput] = []
    for item in items:
        if isinstance(item, RequestOutput):
            run.append(item)
            if not item.finished and (max_run is None or len(run) < max_run):
                continue
        if run:
            out.append(merge_run(run))
            run = []
        if not isinstance(item, RequestOutput):
            out.append(item)
    if run:
        out.append(merge_run(run))
    return out
