"""Applying a step's RunnerOutput to the requests it scheduled: each sampled token appended,
the stop rules checked, what stopped finished; each pooled vector finishing its request; the
requests the output rank failed (their
grammar) aborted; and the grammar compiles it reports.

Scheduler.update_from_output calls these with its own state; they run once per step (the loop
over the sampled tokens is the per-request hot path, kept free of helper calls)."""
from __future__ import annotations

import time
from collections.abc import Callable
from itertools import repeat

from engine_common.wire.diff import RunnerOutput
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_result import TokenUpdate, check_stop

_PREEMPTED = int(RequestStatus.PREEMPTED)   # every status above it is a finished one


def apply_sampled_tokens(scheduled: dict[int, Request], runner_out: RunnerOutput,
                         finish: Callable[[Request, RequestStatus], None],
                         max_len: int) -> list[TokenUpdate]:
    """The updates of one step's sampled tokens. `scheduled`: handle -> request of the step's
    computing requests; `finish(request, status)` finishes one that stopped (frees its blocks);
    `max_len`: the scheduler's token limit per request. Tokens of requests finished since the
    step was scheduled are dropped; a preempted one keeps its token (the workers hold it too).
    The requests the worker failed (request_errors) are aborted first: their tokens dropped."""
    updates = []
    if runner_out.request_errors:
        updates = fail_on_worker(scheduled, runner_out.request_errors, finish)
    now = time.monotonic()
    handles, tops = runner_out.handles, runner_out.top_logprobs
    get = scheduled.get
    lps = runner_out.logprobs           # one per sampled token; None where absent
    if len(lps) < len(handles):
        lps = [*lps, *repeat(None, len(handles) - len(lps))]
    for handle, token, lp in zip(handles, runner_out.sampled_token_ids, lps):
        request = get(handle)
        if request is None or request.status > _PREEMPTED:   # finished since scheduled
            continue
        if request.num_pending_tokens:
            request.num_pending_tokens -= 1
        output = request.output_token_ids
        output.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
        # check_stop can fire only on a stop id or at the length limit.
        if token in request.stop_token_ids or len(output) >= request.max_num_output_tokens:
            status = check_stop(request, max_len)
            if status is not None:
                finish(request, status)
                top = tops.get(handle) if tops else None
                updates.append(TokenUpdate.final(request, [token], [] if lp is None else [lp],
                                                 None if top is None else [top]))
                continue
        held = request.held_logprobs
        if held is not None:        # its owner reads the final update alone
            if lp is not None:
                held.append(lp)
            continue
        top = None
        if tops and (top := tops.get(handle)) is not None:
            top = [top]
        # The running case inline (it runs per request and step); a scheduled request's
        # num_cached_tokens is set (>= 0).
        updates.append(TokenUpdate(
            request.request_id, [token], [] if lp is None else [lp], top, None, None,
            request.num_cached_tokens, request.first_scheduled_time,
            request.first_token_time, None, request))
    if runner_out.prompt_logprobs:
        attach_prompt_results(scheduled, runner_out, updates)
    if runner_out.pooled:
        updates += finish_pooled(scheduled, runner_out.pooled, finish)
    return updates


def attach_prompt_results(scheduled: dict[int, Request], runner_out: RunnerOutput,
                          updates: list[TokenUpdate]) -> None:
    """Each request's prompt logprobs onto the update of the token sampled with them (the
    workers send them once, with that token); dropped with the token of a request finished
    since. A step of requests that asked for none never comes here."""
    by_request = {id(u.request): u for u in updates}
    for handle, value in runner_out.prompt_logprobs.items():
        request = scheduled.get(handle)
        update = None if request is None else by_request.get(id(request))
        if update is not None:
            update.prompt_logprobs = value


def finish_pooled(scheduled: dict[int, Request], pooled: dict[int, list[float]],
                  finish: Callable[[Request, RequestStatus], None]) -> list[TokenUpdate]:
    """Finish each pooling request whose vector came back (it samples nothing: the vector is
    its one output, as vLLM's pooling requests end when their prompt is computed). A request
    finished since is left alone; one preempted since (async scheduling) still ends on it: the
    vector was computed in full."""
    updates = []
    now = time.monotonic()
    for handle, vector in pooled.items():
        request = scheduled.get(handle)
        if request is None or request.status > _PREEMPTED:
            continue
        request.first_token_time = now         # time to the vector
        finish(request, RequestStatus.FINISHED_LENGTH)
        update = TokenUpdate.final(request, [], [])
        update.pooled = vector
        updates.append(update)
    return updates


def fail_on_worker(scheduled: dict[int, Request], errors: dict[int, str],
                   finish: Callable[[Request, RequestStatus], None]) -> list[TokenUpdate]:
    """Abort the requests of this step that failed on the output rank (their grammar), each
    with its error; a request finished since is left alone. `errors`: handle -> why."""
    updates = []
    for handle, why in errors.items():
        request = scheduled.get(handle)
        if request is None or request.status > _PREEMPTED:
            continue
        request.error = f"request {request.request_id!r} failed on the worker: {why}"
        finish(request, RequestStatus.FINISHED_ABORTED)
        updates.append(TokenUpdate.final(request, [], []))
    return updates


def grammars_compiled(compiling: dict[int, tuple[Request, int]], step: int,
                      handles: list[int]) -> None:
    """The output rank compiled these handles' grammars by `step`: their requests may sample.
    `compiling`: handle -> (request, step it was sent in); a report from before a recycled
    handle's request was sent is not about it."""
    for handle in handles:
        entry = compiling.get(handle)
        if entry is not None and entry[1] <= step:
            del compiling[handle]
            entry[0].awaiting_grammar = False
