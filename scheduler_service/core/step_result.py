"""What one step's sampled tokens mean for a request: the update handed on, and the stop rules."""
from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.request import Request, RequestStatus


@dataclass(slots=True)
class RequestUpdate:
    """New tokens of one request from one step, for the output processor. Its lists are its
    own (made for this update), so they may be handed on without a copy."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[float]
    # Per new token: (top ids, top logprobs), or None when the request asked for none.
    top_logprobs: list[tuple[list[int], list[float]]] | None
    # True when the scheduler finished the request with this update (request.status says why).
    finished: bool


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
