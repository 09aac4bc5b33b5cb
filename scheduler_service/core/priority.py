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
The running batch is scheduled before H is admitted (step_growth.py): once H needs room, the
new blocks the batch takes this step (a decode crossing into a new block, a prefill chunk) count
against it, as they come out of the same free queue first, less those it frees behind a sliding
window as it grows (not H's prefix hits), and a victim gives back those it would take;
victims are preempted only if the rest of the batch then leaves H some budget and the blocks
for its first chunk.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import Request
from scheduler_service.core.step_growth import step_growth
from scheduler_service.core.waiting_queue import WaitingQueue


def priority_victims(waiting: WaitingQueue, running: Sequence[Request], kv: KVCacheManager,
                     max_num_seqs: int, long_prefill: int, budget: int,
                     held_back: Callable[[Request, list[int]], bool]) -> list[Request]:
    """The running requests to preempt for the first waiting request admission will try (see
    the module docstring); [] when none need to or none can make room. `held_back(r,
    long_priorities)` is the scheduler's long-prefill rule."""
    longs = None        # the running long prefills, looked for once a long one waits
    growth = None       # the batch's new blocks this step, looked at once room is needed
    least_urgent = running[-1].priority if running else None    # running is in that order
    for i in range(len(waiting)):
        head = waiting.at(i)
        if head.num_pending_tokens and head.ends_in_flight:
            continue                  # admission passes it (Scheduler._schedule_waiting)
        hits, num_hit = kv.get_computed_blocks(head)
        left = head.num_tokens - num_hit
        want = left - head.awaiting_grammar
        is_long = left > long_prefill
        if is_long:
            want = min(want, long_prefill)    # its first chunk, as admission caps it
        victims = []
        if least_urgent is not None and least_urgent > head.priority:
            short = (kv.num_free_blocks_needed(head, min(want, budget), hits)
                     - kv.num_free_blocks)
            if short > 0 or len(running) >= max_num_seqs:
                if growth is None:
                    growth = step_growth(running, kv, budget, long_prefill,
                                         {id(b) for b in hits})[0]
                short += sum(growth.values())
            freed = kv.freed_blocks_counter(hits)
            victims = choose_priority_victims(
                head, running, max_num_seqs, short,
                lambda r: freed(r) + (growth or {}).get(r.handle, 0))
            if victims and not fits_beside(head, want, hits, victims, running, kv, budget,
                                           long_prefill):
                victims = []
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
                            freed_blocks: Callable[[Request], int]) -> list[Request]:
    """The running requests to preempt so `head` fits, or [] when it fits already or cannot be
    made to fit. `blocks_short` is how many more free blocks head needs than are free now;
    `freed_blocks(r)`, called for each victim in turn, how many more blocks preempting r too
    returns to the free queue for good (a block victims share returns with the last of them;
    head's own prefix hits never count: head would take them straight back out of it)."""
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
        blocks_short -= freed_blocks(request)
    return victims if seats_short <= 0 and blocks_short <= 0 else []


def fits_beside(head: Request, want: int, hits: Sequence, victims: Sequence[Request],
                running: Sequence[Request], kv: KVCacheManager, budget: int,
                long_prefill: int) -> bool:
    """Whether `head` is admitted this step once `victims` are gone: the rest of the batch,
    scheduled first, leaves some budget, and the free blocks it leaves hold head's chunk (at
    most `want` tokens, its prefix hits `hits`)."""
    gone = {id(v) for v in victims}
    growth, budget_left = step_growth([r for r in running if id(r) not in gone], kv, budget,
                                      long_prefill, {id(b) for b in hits})
    if budget_left <= 0:
        return False
    freed = kv.freed_blocks_counter(hits)
    room = kv.num_free_blocks + sum(freed(v) for v in victims) - sum(growth.values())
    return room >= kv.num_free_blocks_needed(head, min(want, budget_left), hits)
