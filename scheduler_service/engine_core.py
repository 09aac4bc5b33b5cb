"""The scheduling loop: schedule, send the encoded diff to the workers, process what comes back.

The executor is anything with `execute(payload: bytes) -> bytes`: the in-process model runner for
offline use and tests, or the gRPC client of the worker services. Only encoded bytes cross it, so
the in-process engine exercises the same codec as the wire.
"""
from __future__ import annotations

from typing import Protocol

from engine_common.codec import decode_runner_output, encode_scheduler_output
from scheduler_service.output_processor import OutputProcessor, RequestOutput
from scheduler_service.request import Request, RequestStatus
from scheduler_service.scheduler import Scheduler


class StepExecutor(Protocol):
    def execute(self, payload: bytes) -> bytes:
        """Run one step's encoded SchedulerOutput; return the encoded RunnerOutput."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, output_processor: OutputProcessor,
                 executor: StepExecutor):
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.executor = executor

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests at once (cancel, deadline); their blocks go back to the pool."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [out for rid in request_ids if (out := self.output_processor.abort(rid))]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        runner_out = decode_runner_output(self.executor.execute(
            encode_scheduler_output(sched_out)))
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        outputs, stopped_ids = self.output_processor.process(updates)
        if stopped_ids:
            self.scheduler.finish_requests(stopped_ids, RequestStatus.FINISHED_STOP_STRING)
        failed = [out.request_id for out in outputs if out.error is not None]
        if failed:  # their blocks go back now; the workers drop them with the next diff
            self.scheduler.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        return outputs
