"""The long-prefill limits of admission (docs/scheduler.md, "Long prompts"): a prompt with more
than long_prefill_threshold tokens left is long; at most max_long_partial_prefills long prefills
are in progress at once, and requests behind a long one held back may pass it."""
from __future__ import annotations

from engine_common.configuration.config import SchedulerConfig
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import Request
from scheduler_service.core.waiting_queue import WaitingQueue


def held_back(request: Request, long_priorities: list[int], max_long_partial: int) -> bool:
    """Whether a long waiting request waits for the long prefills in progress (their
    priorities): the limit is reached by prefills at least as urgent as it."""
    return len(long_priorities) >= max_long_partial and request.priority >= min(long_priorities)


def can_admit_any(waiting: WaitingQueue, kv: KVCacheManager, num_running: int,
                  config: SchedulerConfig, long_priorities: list[int]) -> bool:
    """Whether a waiting request may be admitted beside these long prefills (seats and the
    long-prefill limit; blocks are not looked at)."""
    if num_running >= config.max_num_seqs:
        return False
    for i in range(len(waiting)):
        request = waiting.at(i)
        if request.num_pending_tokens and request.ends_in_flight:
            continue                  # admission passes it (Scheduler._schedule_waiting)
        num_hit = kv.get_computed_blocks(request)[1]
        if request.num_tokens - num_hit <= config.long_prefill_threshold \
                or not held_back(request, long_priorities, config.max_long_partial_prefills):
            return True
    return False
