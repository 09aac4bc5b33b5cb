"""The scheduling loop: schedule, send the encoded diff to the workers, collect the tokens.

The executor is anything with `execute(payload: bytes) -> bytes`: the in-process model runner for
offline use and tests, or the gRPC client of the worker services. Only encoded bytes cross it, so
the in-process engine exercises the same codec as the wire.

With SchedulerConfig.async_scheduling the executor must also have `submit(payload) -> ticket` and
`collect(ticket) -> bytes` (steps collected in submission order), and each `step()` keeps two
steps in flight: it schedules and submits step t+1, then collects and processes step t.

NOTE EngineCore deals in token ids only. Text (detokenization, stop strings) is its owner's job:
LLMEngine does it between steps on the same thread; AsyncEngine hands each step's TokenUpdates
to the serving side in one batch and hears back which requests a stop string ended.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from engine_common.codec import decode_runner_output, encode_scheduler_output
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.token_update import TokenUpdate


class StepExecutor(Protocol):
    def execute(self, payload: bytes) -> bytes:
        """Run one step's encoded SchedulerOutput; return the encoded RunnerOutput."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: StepExecutor):
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = scheduler.config.async_scheduling
        self._in_flight: deque = deque()   # (SchedulerOutput, ticket), oldest first

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (a ValueError) when it cannot run here."""
        self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> list[TokenUpdate]:
        """Finish requests at once (cancel, deadline); their blocks go back to the pool. One
        final update per request that was still unfinished."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [TokenUpdate.aborted(request) for request in done]

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or (async scheduling) a step still to collect."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[TokenUpdate]:
        """One step's token updates. Async scheduling: submit the next step, then process the
        oldest one in flight (the first call after an idle spell only submits)."""
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

    def _process(self, sched_out, payload: bytes) -> list[TokenUpdate]:
        runner_out = decode_runner_output(payload)
        return [TokenUpdate.from_update(update)
                for update in self.scheduler.update_from_output(sched_out, runner_out)]
