"""What the scheduler's owners read of it between steps (counts, KV usage, the steps in
flight, the adapters in use), apart from the scheduling itself (scheduler.py)."""
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

    @property
    def window_blocks(self) -> tuple[int, int]:
        """A hybrid model's window group's (used, total) blocks (hybrid_kv.py); (0, 0) else."""
        window = getattr(self.kv, "window_group", None)
        if window is None:
            return 0, 0
        return window.num_total_blocks - window.num_free_blocks, window.num_total_blocks

    def _lora_loaded(self, lora_id: int) -> bool:
        """Whether the workers hold adapter `lora_id` now (always without --max-cpu-loras)."""
        return self.lora_cache is None or self.lora_cache.holds(lora_id)

    def lora_ids_wanted(self) -> list[int]:
        """Adapter ids of waiting requests the workers do not hold, in queue order."""
        wanted = []
        for request in self.waiting:
            if not self._lora_loaded(request.lora_id) and request.lora_id not in wanted:
                wanted.append(request.lora_id)
        return wanted

    def lora_ids_running(self) -> set[int]:
        """The adapter ids of running requests: never evicted (--max-cpu-loras)."""
        return {r.lora_id for r in self.running if r.lora_id}

    def lora_ids_in_use(self) -> set[int]:
        """The LoRA adapter ids of unfinished requests (an unloaded id is freed once unused)."""
        return {r.lora_id for r in self._requests.values() if r.lora_id}

    def scheduled_tokens(self, step: int) -> dict[int, int]:
        """handle -> tokens of a step whose output is still expected (handles with 0 left out)."""
        work, counts = self._in_flight.get(step, ({}, {}))
        return {h: counts.get(h, 1) for h in work}

    def scheduled_size(self, step: int) -> tuple[int, int]:
        """(requests, tokens) of scheduled_tokens(step), without a dict per request: the
        counts name every computing request whose count is not 1, and the idle ones (0)."""
        work, counts = self._in_flight.get(step, ({}, {}))
        return len(work), len(work) + sum(n - 1 for n in counts.values() if n)
