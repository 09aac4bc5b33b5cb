"""The scheduling loop: schedule, send the encoded diff to the workers, collect the tokens.

The executor is anything with `execute(payload: bytes) -> bytes`: the in-process model runner for
offline use and tests, or the gRPC client of the worker services. Only encoded bytes cross it, so
the in-process engine exercises the same codec as the wire.

With SchedulerConfig.async_scheduling the executor must also have `submit(payload) -> ticket` and
`collect(ticket) -> bytes` (steps collected in submission order), and each `step()` keeps two
steps in flight: it collects and processes step t, then schedules and submits step t+2 before
its caller turns step t's updates into text (step t+1 runs meanwhile). Workers that pipeline
their steps (InitResult.pipelined: step t+1 launched before step t finishes) get three: step t+3
goes out while t+1 and t+2 are queued on the device, so the reply's trip through the scheduler
(two processes, a Step stream's threads, the GIL shared with the public streams) has two device
steps to hide in, not one. On a 2-core AMD EPYC (Zen 3, AVX2) with a simulated 5.8 ms device and
128 streams over gRPC that round trip took longer than a step (docs/gpu.md, "Measuring without a
GPU").

Finished requests reach the workers in the next step's diff (finished_handles). When nothing is
left to schedule, `has_work()` stays true until a step that computes nothing has carried them:
an idle server's workers must not keep finished requests' state (cached token lists, grammar
matchers) until some later request arrives.

NOTE EngineCore deals in token ids only. Text (detokenization, stop strings) is its owner's job:
LLMEngine does it between steps on the same thread; AsyncEngine hands each step's TokenUpdates
to the serving side in one batch and hears back which requests a stop string ended.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from engine_common.configuration.lora import AdapterNotFound
from engine_common.wire.codec import decode_runner_output, encode_scheduler_output
from engine_common.wire.codec_error import CodecError
from scheduler_service.core.lora_registry import LoRARegistry
from scheduler_service.core.reply_checks import BadReply
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_result import TokenUpdate
from scheduler_service.engine.lora_residency import make_resident, wants_loads
from scheduler_service.engine.lora_updates import LoRAUpdates


class StepExecutor(Protocol):
    def execute(self, payload: bytes) -> bytes:
        """Run one step's encoded SchedulerOutput; return the encoded RunnerOutput."""


@dataclass(slots=True)
class StepStats:
    """What one `step()` call did, for metrics. Seconds of time.perf_counter(); a phase that did
    not happen in this call stays 0 (an async call that only submitted has no round trip)."""

    schedule_s: float = 0.0     # Scheduler.schedule and encoding the diff
    round_trip_s: float = 0.0   # blocked on the workers' reply (execute, or collect)
    update_s: float = 0.0       # decoding the reply, update_from_output, the token updates
    diff_bytes: int = 0         # the encoded diff sent by this call (0: none sent)
    num_reqs: int = 0           # requests with tokens in that diff
    num_tokens: int = 0         # tokens scheduled in that diff
    num_preempted: int = 0      # requests that diff preempted


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: StepExecutor,
                 lora: LoRARegistry | None = None, lora_updates: LoRAUpdates | None = None,
                 steps_in_flight: int = 2):
        """`steps_in_flight` (async scheduling): at most this many steps submitted and not yet
        collected; 3 for workers that pipeline their steps (InitResult.pipelined), where the
        scheduler's round trip for step t+3 then overlaps two device steps (t+1, t+2) instead of
        one. Speculative decoding keeps 2: its drafts over a step in flight assume one."""
        if steps_in_flight < 2:
            raise ValueError(f"steps_in_flight={steps_in_flight} is invalid: must be >= 2")
        self.scheduler = scheduler
        self.executor = executor
        # The adapters served now (runtime loads): a request resolved to one that was unloaded
        # before it got here is refused, never run on a slot another adapter may take.
        self.lora = lora
        # --max-cpu-loras: the adapters loaded on the workers (lora_residency.py)
        self.lora_updates = lora_updates
        scheduler.lora_cache = None if lora_updates is None else lora_updates.cache
        self.async_scheduling = scheduler.config.async_scheduling
        self.steps_in_flight = 2 if scheduler.spec is not None else steps_in_flight
        self._in_flight: deque = deque()   # (SchedulerOutput, ticket), oldest first
        self.last_step = StepStats()

    @property
    def max_steps_in_flight(self) -> int:
        """The most steps this engine keeps submitted and not collected: steps_in_flight with
        async scheduling, else 1 (each step is collected before the next is sent)."""
        return self.steps_in_flight if self.async_scheduling else 1

    @property
    def num_steps_in_flight(self) -> int:
        """Steps submitted to the workers and not collected yet (async scheduling)."""
        return len(self._in_flight)

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (a ValueError) when it cannot run here,
        AdapterNotFound when its LoRA adapter was unloaded since its name was resolved."""
        if self.lora is not None and not self.lora.is_live(request.lora_id,
                                                           request.lora_generation):
            raise AdapterNotFound("lora_name", f"id {request.lora_id}",
                                  "a served LoRA adapter (it was unloaded meanwhile)")
        self.scheduler.add_request(request)

    def drain_in_flight(self) -> list[TokenUpdate]:
        """Collect every step in flight without submitting another: the workers are then
        between steps with nothing queued (a LoRA load or unload goes in there)."""
        updates: list[TokenUpdate] = []
        while self._in_flight:
            sched_out, ticket = self._in_flight.popleft()
            updates += self._process(sched_out, self._wait(self.executor.collect, ticket))
        return updates

    def abort(self, request_ids: list[str]) -> list[TokenUpdate]:
        """Finish requests at once (cancel, deadline); their blocks go back to the pool. One
        final update per request that was still unfinished."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [TokenUpdate.final(request, [], []) for request in done]

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or (async scheduling) a step still to collect."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def has_work(self) -> bool:
        """Something for `step()` to do: has_unfinished_requests, or finished requests the
        workers still cache. An idle engine tells the workers of those in a step that computes
        nothing, else they would hold the requests' state until the next request's step."""
        return self.has_unfinished_requests() or self.scheduler.has_finished_to_send()

    def _has_step_to_send(self) -> bool:
        """Requests to schedule, or finished handles alone with no step in flight (a step in
        flight is collected first: the step after it may carry them with new work)."""
        return self.scheduler.has_unfinished_requests() or (
            not self._in_flight and self.scheduler.has_finished_to_send())

    def step(self) -> list[TokenUpdate]:
        """One step's token updates (`last_step` says what it cost). Async scheduling: submit
        the next step, then process the oldest one in flight (the first call after an idle
        spell only submits). With --max-cpu-loras the adapters waiting requests want are
        loaded first, between steps (the steps in flight collected)."""
        self.last_step = StepStats()
        updates = []
        if wants_loads(self.lora_updates, self.scheduler):
            updates = self.drain_in_flight()
            updates += self.abort(make_resident(self.lora_updates, self.scheduler))
        updates += self._step()
        if self.scheduler.lora_cache is not None:
            self.scheduler.lora_cache.touch(self.scheduler.lora_ids_running())
        return updates

    def _step(self) -> list[TokenUpdate]:
        if not self.async_scheduling:
            sched_out, payload = self._schedule()
            return self._process(sched_out, self._wait(self.executor.execute, payload))
        depth = self.steps_in_flight
        if len(self._in_flight) < depth and self._has_step_to_send():
            self._submit()
            if len(self._in_flight) < depth:
                return []
        if not self._in_flight:
            return []
        sched_out, ticket = self._in_flight.popleft()
        updates = self._process(sched_out, self._wait(self.executor.collect, ticket))
        # The next step goes out before this one's updates are turned into text: the output
        # processing then overlaps the device instead of delaying the next launch. (Finished
        # handles alone wait for a step() that has_work asks for: offline loops end sooner.)
        if self.scheduler.has_unfinished_requests() and len(self._in_flight) < depth:
            self._submit()
        return updates

    def _submit(self) -> None:
        """Schedule a step and submit it; with an executor that says when a submitted step is
        launched (RunnerPipeline), return only then, so the caller's work that follows (output
        processing) does not hold the GIL while the step's inputs are prepared."""
        sched_out, payload = self._schedule()
        ticket = self.executor.submit(payload)
        self._in_flight.append((sched_out, ticket))
        wait_launched = getattr(self.executor, "wait_launched", None)
        if wait_launched is not None:
            wait_launched(ticket)

    def _schedule(self):
        start = time.perf_counter()
        sched_out = self.scheduler.schedule()
        payload = encode_scheduler_output(sched_out)
        stats = self.last_step
        stats.schedule_s = time.perf_counter() - start
        stats.diff_bytes = len(payload)
        # The diff names only counts other than 1; the scheduler knows every request's.
        stats.num_reqs, stats.num_tokens = self.scheduler.scheduled_size(sched_out.step)
        stats.num_preempted = len(sched_out.preempted_handles)
        return sched_out, payload

    def _wait(self, call, arg) -> bytes:
        start = time.perf_counter()
        reply = call(arg)
        self.last_step.round_trip_s = time.perf_counter() - start
        return reply

    def _process(self, sched_out, payload: bytes) -> list[TokenUpdate]:
        start = time.perf_counter()
        try:
            runner_out = decode_runner_output(payload)
        except CodecError as e:          # the workers' fault, as a reply that breaks a rule
            raise BadReply(f"the workers' reply to step {sched_out.step} does not decode: {e}; "
                           "the step fails as a worker fault (a buggy or version-skewed "
                           "worker)") from None
        updates = self.scheduler.update_from_output(sched_out, runner_out)
        self.last_step.update_s = time.perf_counter() - start
        return updates
