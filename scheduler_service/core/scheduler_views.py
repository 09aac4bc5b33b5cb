"""What the scheduler's owners read of it between steps (counts, KV usage), apart from
the scheduling itself (scheduler.py)."""
from __future__ import annotations


class SchedulerViews:
    """Read-only views of a Scheduler's state (mixed into Scheduler)."""

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_finished_to_send(self) -> bool:
        """Finished handles the workers have not been told about yet (sent with the next diff)."""
        return bool(self._finished_handles)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.kv.stats.hit_rate

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv.num_total_blocks
