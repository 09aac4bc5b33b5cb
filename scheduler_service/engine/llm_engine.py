"""EngineCore and OutputProcessor on one thread: the offline engine (deltaserve.llm) and tests.

Each step's text is made right after the step, so a request that matched a stop string is
finished before the next step is scheduled: no token is ever computed past a stop string here.
"""
from __future__ import annotations

from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.output_processor import OutputProcessor, RequestOutput
from scheduler_service.core.step_result import TokenUpdate


class LLMEngine:
    def __init__(self, core: EngineCore, output_processor: OutputProcessor):
        self.core = core
        self.output_processor = output_processor

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (a ValueError) when it cannot run here."""
        if self.output_processor.reads_final_update_only(request):
            request.held_logprobs = []      # no update per step: the final one says it all
        self.core.add_request(request)
        self.output_processor.add_request(request)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish requests at once; their final outputs (held-back text flushed)."""
        return self._outputs(self.core.abort(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones the workers still cache (EngineCore.has_work)."""
        return self.core.has_work()

    def step(self) -> list[RequestOutput]:
        """One engine step's outputs (none for an async-scheduling step that only submitted)."""
        return self._outputs(self.core.step())

    def _outputs(self, updates: list[TokenUpdate]) -> list[RequestOutput]:
        outputs, stopped_ids = self.output_processor.process(updates)
        finish = self.core.scheduler.finish_requests
        finish(stopped_ids, RequestStatus.FINISHED_STOP_STRING)
        # A request whose output failed: its blocks go back now, the workers drop it next step.
        finish([out.request_id for out in outputs if out.error is not None],
               RequestStatus.FINISHED_ABORTED)
        return outputs
