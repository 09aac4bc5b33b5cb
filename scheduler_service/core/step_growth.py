"""What the running batch takes in one step before any waiting request is admitted: the new
KV blocks and the token budget, as Scheduler._schedule_running hands them out. Priority
preemption (priority.py) counts them: a block or budget a victim frees goes to the batch first.
Also `advance`: what a scheduled step does to a request's counts.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import Request


def step_growth(running: Sequence[Request], kv: KVCacheManager, budget: int,
                long_prefill: int, taken_back: Collection[int] = ()
                ) -> tuple[dict[int, int], int]:
    """(handle -> new blocks each request takes, net of those it frees behind a sliding
    window first (negative: it gives back more than it takes), those with none left out; the
    budget left) for `running` scheduled while a request waits: in batch order, long prefills
    (more than `long_prefill` tokens left) after the rest with at most `long_prefill` tokens
    each. A request awaiting its grammar's compile leaves its sampling position out.
    `taken_back`: ids of the waiting request's prefix hits (freed, they are not room)."""
    growth, longs = {}, []
    for request in running:
        left = _tokens_left(request)
        if left > long_prefill:
            longs.append(request)
            continue
        budget = _grow(growth, kv, request, min(left - request.awaiting_grammar, budget),
                       budget, taken_back)
    for request in longs:
        left = _tokens_left(request) - request.awaiting_grammar
        budget = _grow(growth, kv, request, min(left, long_prefill, budget), budget,
                       taken_back)
    return growth, budget


def _tokens_left(request: Request) -> int:
    """Known and pending tokens not computed yet; 0 when a pending token is its last."""
    num_output, pending = request.num_output_tokens, request.num_pending_tokens
    if pending and num_output + pending >= request.max_num_output_tokens:
        return 0
    return request.num_tokens + pending - request.num_computed_tokens


def _grow(growth: dict[int, int], kv: KVCacheManager, request: Request, n: int,
          budget: int, taken_back: Collection[int]) -> int:
    """Record the blocks `n` more tokens of `request` take (grow_slots frees those behind its
    window first); returns the budget left."""
    if n > 0:
        need = kv.num_free_blocks_needed(request, n) - kv.num_freed_by_window(request,
                                                                               taken_back)
        if need:
            growth[request.handle] = need
        budget -= n
    return budget


def advance(request: Request, n: int, num_known_and_pending: int) -> None:
    """The step is assumed to run: its tokens count as computed at once, and a request whose
    step reaches past its known and pending tokens samples one more (pending)."""
    request.num_computed_tokens += n
    if request.num_computed_tokens >= num_known_and_pending:
        request.num_pending_tokens += 1
