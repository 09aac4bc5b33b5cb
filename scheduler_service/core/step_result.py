"""What one step's sampled tokens mean for a request: the update handed on, and the stop rules."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine_common.wire.diff import PromptLogprobs
from scheduler_service.core.request import Request, RequestStatus


@dataclass(slots=True)
class TokenUpdate:
    """New tokens of one request from one engine step: the one object on a token's way from the
    scheduler to the output processor (no second copy per request and step).

    Every fact the output processor reads is copied in when the update is made, so the serving
    side (another thread) may read it while the engine goes on mutating its requests. `request`
    is the engine's own object, for the engine side and its tests only: the output processor
    never reads it. The token lists are made fresh for each update (never the Request's own).

    finish_reason is set when the engine finished the request with this update: FINISHED_LENGTH,
    FINISHED_STOP_TOKEN (stop_token_id says which), or FINISHED_ABORTED (no tokens then; `error`
    says why when the request failed, on the worker). Stop strings are not the engine's
    business: the serving side finds them and tells the engine.
    Times are time.monotonic() seconds; None until it happened.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    # Per new token: (top ids, top logprobs), or None when the request asked for none.
    top_logprobs: list[tuple[list[int], list[float]]] | None
    finish_reason: RequestStatus | None
    stop_token_id: int | None
    num_cached_tokens: int          # prompt tokens the prefix cache served (0 before scheduling)
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    request: Request | None = field(default=None, repr=False, compare=False)
    error: str | None = None
    # The prompt's logprobs (a request that asked for them), on the update of its first token.
    prompt_logprobs: PromptLogprobs | None = None
    # A pooling request's vector (float32 values), on its one update.
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def first(self, n: int) -> "TokenUpdate":
        """This update with its first `n` tokens only (and their logprobs)."""
        top = self.top_logprobs
        return dataclasses.replace(self, new_token_ids=self.new_token_ids[:n],
                                   new_logprobs=self.new_logprobs[:n],
                                   top_logprobs=None if top is None else top[:n])

    @classmethod
    def final(cls, request: Request, new_token_ids: list[int], new_logprobs: list[float],
              top_logprobs=None) -> "TokenUpdate":
        """The last update of `request`, which the engine just finished (`request.status` says
        why: a stop rule after this step's tokens, or an abort with none). The running case is
        built inline in Scheduler.update_from_output, where it runs per request and step.
        A request whose updates are held (Request.held_logprobs) gets every output token and
        logprob here, since none went out before."""
        reason = request.status
        held = request.held_logprobs
        if held is not None:     # no update was made before: this one carries every token
            new_token_ids, new_logprobs = list(request.output_token_ids), held + new_logprobs
        stop_token = request.stop_reason if reason == RequestStatus.FINISHED_STOP_TOKEN else None
        return cls(request.request_id, new_token_ids, new_logprobs, top_logprobs, reason,
                   stop_token, max(0, request.num_cached_tokens),
                   request.first_scheduled_time, request.first_token_time,
                   request.finish_time, request, request.error)


def check_stop(request: Request, max_len: int) -> RequestStatus | None:
    """The finish status after the request's last output token, or None to keep going.

    Rules, in order:
      1. the token is a stop id (eos unless ignore_eos, or stop_token_ids) sampled after at least
         min_tokens earlier tokens (the sampler masks stop ids until then), or by a constrained
         request at any point (a complete grammar allows only eos: the grammar wins over
         min_tokens)                                                    -> FINISHED_STOP_TOKEN
      2. max_tokens outputs                                             -> FINISHED_LENGTH
      3. max_len tokens in all (max_model_len, capped by KV capacity)  -> FINISHED_LENGTH
    """
    last = request.output_token_ids[-1]
    stopping = request.stopping
    if (request.num_output_tokens > stopping.min_tokens or request.constraint is not None) \
            and last in request.stop_token_ids:
        request.stop_reason = last
        return RequestStatus.FINISHED_STOP_TOKEN
    if stopping.max_tokens is not None and request.num_output_tokens >= stopping.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_len:
        return RequestStatus.FINISHED_LENGTH
    return None
