"""The model runner behind the engine's byte-level executor interface, for the offline LLM: steps
run in order on one runner thread (async scheduling), pipelined where the runner's launches are
asynchronous (CUDA, the simulated device). `close()` ends that thread.
"""
from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading

from engine_common.wire.codec import encode_runner_output
from worker_service.runner.model_runner import ModelRunner


class InProcessExecutor:
    """A model runner behind the byte-level executor interface. `submit` runs steps in order on
    one runner thread (async scheduling: the scheduler works while the model runs).

    Where the runner's launches are asynchronous (CUDA, the simulated device: runner.pipelined)
    the runner thread launches step t+1 *before* it finishes step t, so the device always has
    the next step queued while the host records step t's tokens and the engine thread processes
    them and schedules step t+2. `collect(t)` returns once step t is finished; when no later step
    was submitted, it asks the runner thread to finish step t on its own.

    Elsewhere (CPU) `collect(step t)` returns once step t is done *and* step t+1, when
    submitted, has reached its sampler (or ended). The engine thread's Python (outputs of t,
    scheduling t+2) then runs while the runner is inside the LM head and sampler, which hold no
    GIL. Returning at once instead put it beside the Python that prepares step t+1's inputs, and
    the two threads took turns on the GIL: the runner spent about 4.5 ms a step waiting
    (step-overhead, 1 thread), more than async scheduling saved.
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        # The step in hand and the runner's last step before it, until the runner returns it.
        self._unreturned: tuple[bytes, int] | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._sampling: collections.deque[threading.Event] = collections.deque()
        self._pipeline: RunnerPipeline | None = None
        self._closing: tuple = (None, None)      # what close() ended, for wait_closed

    def execute(self, payload: bytes) -> bytes:
        if self._unreturned is not None:
            missed, before = self._unreturned
            if before is not None and self._last_step() == before:
                # Interrupted (Ctrl-C) before the runner took that step: the scheduler counted
                # it, so every later diff builds on it. Its tokens were for requests aborted
                # since; before, every later step failed ("step N arrived after step M").
                self.runner.execute(missed)
        self._unreturned = (payload, self._last_step())
        reply = encode_runner_output(self.runner.execute(payload))
        self._unreturned = None
        return reply

    def _last_step(self) -> int | None:
        return getattr(self.runner, "last_step", None)     # (test doubles have none)

    def submit(self, payload: bytes) -> concurrent.futures.Future | PipelineTicket:
        if self.runner.pipelined:
            if self._pipeline is None:
                self._pipeline = RunnerPipeline(self.runner)
            return self._pipeline.submit(payload)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "runner")
        sampling = threading.Event()
        self._sampling.append(sampling)
        return self._thread.submit(self._execute_submitted, payload, sampling)

    def _execute_submitted(self, payload: bytes, sampling: threading.Event) -> bytes:
        self.runner.on_sampling = sampling.set
        try:
            return self.execute(payload)
        finally:
            self.runner.on_sampling = None
            sampling.set()

    def wait_launched(self, ticket: concurrent.futures.Future | PipelineTicket) -> None:
        """Pipelined: block until the submitted step is launched (or failed)."""
        if self._pipeline is not None:
            self._pipeline.wait_launched(ticket)

    def collect(self, ticket: concurrent.futures.Future | PipelineTicket) -> bytes:
        """Tickets are collected in submission order."""
        if self._pipeline is not None:
            return self._pipeline.collect(ticket)
        self._sampling.popleft()
        reply = ticket.result()
        if self._sampling:
            self._sampling[0].wait()
        return reply

    def close(self, wait: bool = True) -> None:
        """End the runner thread, once the steps submitted are done (`wait`: return only then).
        The pipeline's thread held the runner, and with it the model and the KV cache, for the
        life of the process."""
        pipeline, pool = self._pipeline, self._thread
        self._pipeline = self._thread = None
        self._closing = (pipeline, pool)
        if pipeline is not None:
            pipeline.close(wait)
        if pool is not None:
            pool.shutdown(wait=wait)

    def ran_no_thread(self) -> bool:
        """Whether close() ended no runner thread (steps ran on the caller's: sync)."""
        return self._closing == (None, None)

    def wait_closed(self) -> None:
        """Return once the runner thread that close() ended is gone (after close(wait=False):
        its steps were still running)."""
        pipeline, pool = self._closing
        if pipeline is not None:
            pipeline.join()
        if pool is not None:
            pool.shutdown(wait=True)


_FINISH = object()      # RunnerPipeline's queue: finish the step in hand now
_STOP = object()        # RunnerPipeline's queue: finish the step in hand, then end the thread


class PipelineTicket:
    """One step submitted to a RunnerPipeline. Two locks, each held from submission until the
    runner thread lets go of it once: `launched` (the step is launched, or failed) and `done`
    (its reply or error is in). A waiter takes a lock and gives it back at once, so any number
    of waits pass once it is let go. Lighter than a Future and an Event (no condition variable,
    no waiter lock allocated per wait): about half the hand-off time per step."""

    __slots__ = ("payload", "reply", "error", "_launched", "_done")

    def __init__(self, payload: bytes):
        self.payload = payload
        self.reply: bytes | None = None
        self.error: BaseException | None = None
        self._launched = threading.Lock()
        self._launched.acquire()
        self._done = threading.Lock()
        self._done.acquire()

    def set_launched(self) -> None:
        self._launched.release()

    def wait_launched(self) -> None:
        with self._launched:
            pass

    def set_result(self, reply: bytes | None, error: BaseException | None = None) -> None:
        self.reply, self.error = reply, error
        self._done.release()

    def done(self) -> bool:
        return not self._done.locked()

    def result(self) -> bytes:
        with self._done:
            pass
        if self.error is not None:
            raise self.error
        return self.reply


class RunnerPipeline:
    """One runner thread that launches each submitted step before finishing the one before it
    (ModelRunner.launch_step(diff, feed=previous)). A step whose inputs need the previous
    step's ids on the host (grammar masks, penalties) waits for that step's finish instead."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._last: PipelineTicket | None = None
        self._thread = threading.Thread(target=self._loop, name="runner", daemon=True)
        self._thread.start()

    def submit(self, payload: bytes) -> PipelineTicket:
        ticket = self._last = PipelineTicket(payload)
        self._queue.put(ticket)
        return ticket

    @staticmethod
    def wait_launched(ticket: PipelineTicket) -> None:
        ticket.wait_launched()

    def collect(self, ticket: PipelineTicket) -> bytes:
        if ticket is self._last and not ticket.done():
            self._queue.put(_FINISH)
        return ticket.result()

    def close(self, wait: bool = True) -> None:
        self._queue.put(_STOP)
        if wait:
            self._thread.join()

    def join(self) -> None:
        self._thread.join()

    def _loop(self) -> None:
        held = None                       # (PendingStep, PipelineTicket): launched, not finished
        while True:
            ticket = self._queue.get()
            if ticket is _FINISH or ticket is _STOP:
                held = self._finish(held)
                if ticket is _STOP:
                    return
                continue
            try:
                diff = self.runner.decode(ticket.payload)
                if held is not None and self.runner.needs_host_tokens(diff):
                    held = self._finish(held)
                launched = self.runner.launch_step(diff, held and held[0])
            except BaseException as e:    # this step fails; the one before it still finishes
                self._finish(held)
                held = None
                ticket.set_result(None, e)
                ticket.set_launched()
                continue
            ticket.set_launched()
            self._finish(held)
            held = (launched, ticket)

    def _finish(self, held) -> None:
        if held is None:
            return None
        pending, ticket = held
        try:
            reply = encode_runner_output(self.runner.finish_step(pending))
        except BaseException as e:
            ticket.set_result(None, e)
        else:
            ticket.set_result(reply)
        return None
