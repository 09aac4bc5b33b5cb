"""What the engine hands the serving side per request and step: token ids, never text.

A TokenUpdate is a copy, not a view of the Request: the engine thread goes on mutating its
requests while the serving side (another thread) turns updates into text, so every fact the
output processor needs is copied here when the step's output is processed.
"""
from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_result import RequestUpdate


@dataclass(slots=True)
class TokenUpdate:
    """New tokens of one request from one engine step.

    finish_reason is set when the engine finished the request with this update: FINISHED_LENGTH,
    FINISHED_STOP_TOKEN (stop_token_id says which), or FINISHED_ABORTED (no tokens then). Stop
    strings are not the engine's business: the serving side finds them and tells the engine.
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_update(cls, update: RequestUpdate) -> "TokenUpdate":
        """A copy of the scheduler's update and of the request facts it implies."""
        r = update.request
        reason = r.status if update.finished else None
        stop_token = r.stop_reason if reason == RequestStatus.FINISHED_STOP_TOKEN else None
        # The update's lists are made fresh for each step (never the Request's own): no copy.
        return cls(r.request_id, update.new_token_ids, update.new_logprobs,
                   update.top_logprobs, reason, stop_token, max(0, r.num_cached_tokens),
                   r.first_scheduled_time, r.first_token_time,
                   r.finish_time if update.finished else None)

    @classmethod
    def aborted(cls, request: Request) -> "TokenUpdate":
        """The final update of a request the engine aborted (no new tokens)."""
        return cls(request.request_id, [], [], None, RequestStatus.FINISHED_ABORTED, None,
                   max(0, request.num_cached_tokens), request.first_scheduled_time,
                   request.first_token_time, request.finish_time)
