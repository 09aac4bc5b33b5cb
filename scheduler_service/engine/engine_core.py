"""The scheduling loop: schedule, send the encoded diff to the workers, process what comes back.

The executor is anything with `execute(payload: bytes) -> bytes`: the in-process model runner for
offline use and tests, or the gRPC client of the worker services. Only encoded bytes cross it, so
the in-process engine exercises the same codec as the wire.

With SchedulerConfig.async_scheduling the executor must also have `submit(payload) -> ticket` and
`collect(ticket) -> bytes` (steps collected in submission order), and each `step()` keeps two
steps in flight: it schedules and submits step t+1, then collects and processes step t.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from engine_common.codec import decode_runner_output, encode_scheduler_output
from scheduler_service.engine.output_processor import OutputProcessor, RequestOutput
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler


class StepExecutor(Protocol):
    def execute(self, payload: bytes) -> bytes:
        """Run one step's encoded SchedulerOutput; return the encoded RunnerOutput."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, output_processor: OutputProcessor,
                 executor: StepExecutor):
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.executor = executor
        self.async_scheduling = scheduler.config.async_scheduling
        self._in_flight: deque = deque()   # (SchedulerOutput, ticket), oldest first

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests at once (cancel, deadline); their blocks go back to the pool."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [out for rid in request_ids if (out := self.output_processor.abort(rid))]

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or (async scheduling) a step still to collect."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """One step's outputs. Async scheduling: submit the next step, then process the oldest
        one in flight (the first call after an idle spell only submits)."""
        if not self.async_scheduling:
            sched_out = self.scheduler.schedule()
            return self._process(sched_out, self.executor.execute(
                encode_scheduler_output(sched_out)))
        if self.scheduler.has_unfinished_requests():
            sched_out = self.scheduler.schedule()
            ticket = self.executor.submit(encode_scheduler_output(sched_out))
            self._in_flight.append((sched_out, ticket))
            if len(self._in_flight) < 2:
                return []
        if not self._in_flight:
            return []
        sched_out, ticket = self._in_flight.popleft()
        return self._process(sched_out, self.executor.collect(ticket))

    def _process(self, sched_out, payload: bytes) -> list[RequestOutput]:
        runner_out = decode_runner_output(payload)
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        outputs, stopped_ids = self.output_processor.process(updates)
        if stopped_ids:
            self.scheduler.finish_requests(stopped_ids, RequestStatus.FINISHED_STOP_STRING)
        failed = [out.request_id for out in outputs if out.error is not None]
        if failed:  # their blocks go back now; the workers drop them with the next diff
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        return outputs
