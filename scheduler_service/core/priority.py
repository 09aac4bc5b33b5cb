"""Priority preemption: which running requests make way for a more urgent waiting one.

The waiting queue's head H (its most urgent request) may preempt running requests of strictly
lower priority (a higher `priority` value), least urgent and latest-arriving first, but only when
that frees enough: a seat under max_num_seqs and the free blocks H's first chunk needs. Equal
priorities never preempt each other, so FCFS within a priority level is unchanged. When even
every eligible victim would not make room, nobody is preempted (no preemption for nothing).

H is the first waiting request admission will try: long ones (more than the long-prefill
threshold left) that the long-prefill limit holds back are passed by, also when the victims'
own long prefills are gone (a victim would only be readmitted past them and preempted again the
next step). A long H's room is its first chunk (the threshold), as admission caps it, and a
victim's blocks that H hits in the prefix cache make no room (H takes them straight back).
The running batch is scheduled before H is admitted: once H needs room, the new blocks the
batch takes this step (a decode crossing into a new block, a prefill chunk) count against it,
as they come out of the same free queue first, and a victim gives back those it would take.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import Request
from scheduler_service.core.waiting_queue import WaitingQueue


def priority_victims(waiting: WaitingQueue, running: Sequence[Request], kv: KVCacheManager,
                     max_num_seqs: int, long_prefill: int, budget: int,
                     held_back: Callable[[Request, list[int]], bool]) -> list[Request]:
    """The running requests to preempt for the first waiting request admission will try (see
    the module docstring); [] when none need to or none can make room. `held_back(r,
    long_priorities)` is the scheduler's long-prefill rule."""
    longs = None        # the running long prefills, looked for once a long one waits
    growth = None       # the batch's new blocks this step, looked at once room is needed
    for i in range(len(waiting)):
        head = waiting.at(i)
        hits, num_hit = kv.get_computed_blocks(head)
        left = head.num_tokens - num_hit
        n = min(left - head.awaiting_grammar, budget)
        is_long = left > long_prefill
        if is_long:
            n = min(n, long_prefill)          # its first chunk, as admission caps it
        short = kv.num_free_blocks_needed(head, n, hits) - kv.num_free_blocks
        if short > 0 or len(running) >= max_num_seqs:
            if growth is None:
                growth = step_growth(running, kv, budget, long_prefill)
            short += sum(growth.values())
        victims = choose_priority_victims(
            head, running, max_num_seqs, short,
            lambda r: kv.num_exclusive_blocks(r, hits) + (growth or {}).get(r.handle, 0))
        if is_long:
            if longs is None:
                longs = [r for r in running if r.num_tokens + r.num_pending_tokens
                         - r.num_computed_tokens > long_prefill]
            gone = {v.handle for v in victims}
            if held_back(head, [r.priority for r in longs if r.handle not in gone]):
                continue
        return victims
    return []


def choose_priority_victims(head: Request, running: Sequence[Request], max_num_seqs: int,
                            blocks_short: int,
                            exclusive_blocks: Callable[[Request], int]) -> list[Request]:
    """The running requests to preempt so `head` fits, or [] when it fits already or cannot be
    made to fit. `blocks_short` is how many more free blocks head needs than are free now;
    `exclusive_blocks(r)` how many blocks preempting r returns to the free queue for good (not
    counting head's own prefix hits, which head would take straight back out of it)."""
    seats_short = len(running) + 1 - max_num_seqs
    if seats_short <= 0 and blocks_short <= 0:
        return []
    eligible = sorted((r for r in running if r.priority > head.priority),
                      key=lambda r: (r.priority, r.arrival_time), reverse=True)
    victims = []
    for request in eligible:
        if seats_short <= 0 and blocks_short <= 0:
            break
        victims.append(request)
        seats_short -= 1
        blocks_short -= exclusive_blocks(request)
    return victims if seats_short <= 0 and blocks_short <= 0 else []


def step_growth(running: Sequence[Request], kv: KVCacheManager, budget: int,
                long_prefill: int) -> dict[int, int]:
    """handle -> new blocks each running request takes this step before admission (those
    taking none left out), as Scheduler._schedule_running hands out the budget: in batch
    order, long prefills after the rest with at most `long_prefill` tokens (a request waits).
    A request awaiting its grammar's compile leaves its sampling position out."""
    growth, longs = {}, []
    for request in running:
        left = _tokens_left(request)
        if left > long_prefill:
            longs.append(request)
            continue
        budget = _grow(growth, kv, request, min(left - request.awaiting_grammar, budget),
                       budget)
    for request in longs:
        left = _tokens_left(request) - request.awaiting_grammar
        budget = _grow(growth, kv, request, min(left, long_prefill, budget), budget)
    return growth


def _tokens_left(request: Request) -> int:
    """Known and pending tokens not computed yet; 0 when a pending token is its last."""
    num_output, pending = request.num_output_tokens, request.num_pending_tokens
    if pending and num_output + pending >= request.max_num_output_tokens:
        return 0
    return request.num_tokens + pending - request.num_computed_tokens


def _grow(growth: dict[int, int], kv: KVCacheManager, request: Request, n: int,
          budget: int) -> int:
    """Record the blocks `n` more tokens of `request` take; returns the budget left."""
    if n > 0:
        need = kv.num_free_blocks_needed(request, n)
        if need:
            growth[request.handle] = need
        budget -= n
    return budget
