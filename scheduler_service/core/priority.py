"""Priority preemption: which running requests make way for a more urgent waiting one.

The waiting queue's head H (its most urgent request) may preempt running requests of strictly
lower priority (a higher `priority` value), least urgent and latest-arriving first, but only when
that frees enough: a seat under max_num_seqs and the free blocks H's first chunk needs. Equal
priorities never preempt each other, so FCFS within a priority level is unchanged. When even
every eligible victim would not make room, nobody is preempted (no preemption for nothing).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler_service.core.request import Request


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
