"""One step's plan as the scheduler builds it, and the SchedulerOutput diff made from it."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_common.wire.diff import (NO_LOGPROBS, NewRequestData, ResumedRequestData,
                                     SchedulerOutput)
from engine_common.request.params import WorkerSamplingParams
from scheduler_service.core.request import Request


@dataclass
class StepPlan:
    """What one schedule() call decided, in the order it decided it."""

    budget: int                                             # tokens still free this step
    # handle -> request, for every request that computes something this step (what
    # update_from_output expects back); `counts` has the token count when it is not 1.
    work: dict[int, Request] = field(default_factory=dict)
    # handle -> tokens this step for every request in the batch whose count is not 1 (0 = idle):
    # the diff's num_scheduled_tokens.
    counts: dict[int, int] = field(default_factory=dict)
    new_requests: list[NewRequestData] = field(default_factory=list)
    resumed_requests: list[ResumedRequestData] = field(default_factory=list)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)
    preempted_handles: list[int] = field(default_factory=list)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)   # spec_decode.py
    # handle -> [num tokens, last token]: what drafts over a step in flight assumed (async)
    spec_assumed: dict[int, list[int]] = field(default_factory=dict)

    def schedule(self, request: Request, num_tokens: int) -> None:
        handle = request.handle
        if num_tokens:
            self.work[handle] = request
        if num_tokens != 1:
            self.counts[handle] = num_tokens
        self.budget -= num_tokens

    def add_new(self, request: Request, block_ids: list[int], num_computed: int) -> None:
        sampling = WorkerSamplingParams(request.sampling, request.seed,
                                        request.stopping.min_tokens, request.min_tokens_stop_ids)
        # The request's own prompt list (it never changes; the workers copy what they keep)
        # and its uint32 bytes from admission: the codec converts no id again.
        self.new_requests.append(NewRequestData(
            request.handle, request.prompt_token_ids, sampling, block_ids, num_computed,
            NO_LOGPROBS if request.num_logprobs is None else request.num_logprobs,
            request.constraint, NO_LOGPROBS if request.num_prompt_logprobs is None
            else request.num_prompt_logprobs, request.pooling, request.lora_id,
            request.prompt_u32))

    def add_resumed(self, request: Request, block_ids: list[int], num_computed: int) -> None:
        self.resumed_requests.append(ResumedRequestData(request.handle, block_ids, num_computed))

    def tokens_by_handle(self) -> dict[int, int]:
        """Every handle that computes something this step -> its token count."""
        return {h: self.counts.get(h, 1) for h in self.work}


def build_output(step: int, plan: StepPlan, finished_handles: list[int]) -> SchedulerOutput:
    """The diff: counts only where they differ from the default of one token."""
    return SchedulerOutput(
        step=step,
        new_requests=plan.new_requests,
        resumed_requests=plan.resumed_requests,
        new_block_ids=plan.new_block_ids,
        num_scheduled_tokens=plan.counts,
        finished_handles=list(finished_handles),
        preempted_handles=plan.preempted_handles,
        spec_token_ids=plan.spec_token_ids,
        spec_assumed=plan.spec_assumed,
    )
