"""Which requests the scheduler accepts, the typed errors for those it refuses, and what it sets
on one it accepts."""
from __future__ import annotations

from array import array

from engine_common.request.pooling import NO_POOLING, is_whole_prompt
from scheduler_service.core.request import Request, RequestStatus


class RequestRejected(ValueError):
    """A request that can never run here. Carries the field, the value and the allowed range
    (the gRPC layer maps it to INVALID_ARGUMENT)."""

    def __init__(self, request_id: str, field_name: str, value, allowed: str):
        self.request_id = request_id
        self.field = field_name
        self.value = value
        self.allowed = allowed
        super().__init__(f"request {request_id!r} rejected: {field_name}={value!r} "
                         f"must be {allowed}")


class QueueFull(RequestRejected):
    """Too many requests waiting already; retry later (RESOURCE_EXHAUSTED)."""


_MAX_TOKEN_ID = 2**32 - 1


def check_admission(request: Request, *, max_model_len: int, block_size: int, num_blocks: int,
                    num_waiting: int, max_waiting: int, known: bool,
                    max_step_tokens: int | None = None) -> None:
    """Raise RequestRejected / QueueFull unless `request` may join the waiting queue.
    `max_step_tokens`: the step's token budget, which an encoder's prompt must fit whole."""
    rid = request.request_id
    if known:
        raise RequestRejected(rid, "request_id", rid, "unique among unfinished requests")
    prompt = request.prompt_token_ids
    if not prompt:
        raise RequestRejected(rid, "prompt_token_ids", "(empty)", "at least 1 token")
    try:        # one pass in C: every id an integer in [0, 2**32 - 1]
        request.prompt_u32 = array("I", prompt).tobytes()
    except (TypeError, OverflowError, ValueError):
        lo, hi = min(prompt), max(prompt)      # the id to name, as before
        if lo < 0 or hi > _MAX_TOKEN_ID:
            bad = lo if lo < 0 else hi
            raise RequestRejected(rid, "prompt_token_ids", bad,
                                  f"token ids in [0, {_MAX_TOKEN_ID}]") from None
    max_tokens = request.stopping.max_tokens
    if request.pooling != NO_POOLING:
        _check_pooling_prompt(request, max_model_len, max_step_tokens)
    total = len(prompt) + (max_tokens or 1) * (request.pooling == NO_POOLING)
    if total > max_model_len:
        raise RequestRejected(rid, "prompt tokens + max_tokens", total,
                              f"<= max_model_len ({max_model_len})")
    # With max_tokens unset, min_tokens is bounded by nothing else; the worker holds it in an
    # int32 and refuses a step carrying more (BAD_PAYLOAD: every request of the epoch fails).
    min_tokens = request.stopping.min_tokens
    if len(prompt) + min_tokens > max_model_len:
        raise RequestRejected(rid, "min_tokens", min_tokens,
                              f"<= {max_model_len - len(prompt)} (max_model_len {max_model_len}"
                              f" - {len(prompt)} prompt tokens)")
    allowed = request.sampling.allowed_token_ids
    if min_tokens and allowed and set(allowed) <= set(request.min_tokens_stop_ids):
        # Before min_tokens every allowed id is masked: the sampler would see every logit -inf.
        raise RequestRejected(rid, "allowed_token_ids", list(allowed)[:8],
                              "not only eos and stop_token_ids while min_tokens > 0 (until "
                              "min_tokens no allowed id could be sampled)")
    if -(-len(prompt) // block_size) > num_blocks:
        raise RequestRejected(rid, "prompt tokens", len(prompt),
                              f"<= KV-cache capacity ({num_blocks * block_size} tokens)")
    if num_waiting >= max_waiting:
        raise QueueFull(rid, "waiting requests", num_waiting, f"< max_waiting ({max_waiting})")


def _check_pooling_prompt(request: Request, max_model_len: int,
                          max_step_tokens: int | None) -> None:
    """A pooling prompt samples nothing, so it may fill max_model_len; an encoder's must also
    fit one step (it is never chunked)."""
    n = len(request.prompt_token_ids)
    if n > max_model_len:
        raise RequestRejected(request.request_id, "prompt tokens", n,
                              f"<= max_model_len ({max_model_len})")
    if is_whole_prompt(request.pooling) and max_step_tokens is not None \
            and n > max_step_tokens:
        raise RequestRejected(request.request_id, "prompt tokens", n,
                              f"<= max_num_batched_tokens ({max_step_tokens}): an encoder "
                              "model computes a prompt in one step")


def prepare_queued(request: Request, handle: int, seed: int, max_len: int) -> None:
    """Set what the scheduler derives for an accepted request before it waits: its handle, its
    concrete seed, WAITING, whether it waits for its grammar's compile, and its output cap
    (max_tokens, and what fits under `max_len`, the scheduler's tokens per request)."""
    request.handle = handle
    request.seed = seed
    request.status = RequestStatus.WAITING
    request.awaiting_grammar = request.constraint is not None
    max_tokens = request.stopping.max_tokens
    request.max_num_output_tokens = min(
        max_len - request.num_prompt_tokens, max_len if max_tokens is None else max_tokens)
