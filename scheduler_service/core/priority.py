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
    for i in range(len(waiting)):
        head = waiting.at(i)
        hits, num_hit = kv.get_computed_blocks(head)
        left = head.num_tokens - num_hit
        n = min(left - head.awaiting_grammar, budget)
        is_long = left > long_prefill
        if is_long:
            n = min(n, long_prefill)          # its first chunk, as admission caps it
        short = kv.num_free_blocks_needed(head, n, hits) - kv.num_free_blocks
        victims = choose_priority_victims(head, running, max_num_seqs, short,
                                          lambda r: kv.num_exclusive_blocks(r, hits))
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
