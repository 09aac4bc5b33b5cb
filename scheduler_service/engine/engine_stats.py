"""The engine thread's published snapshot of the scheduler's load (immutable, replaced after
every loop turn). GetServerStatus and the Prometheus gauges both read it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    ready: bool = False
    num_waiting: int = 0
    num_running: int = 0
    num_used_blocks: int = 0     # held by live requests (free cached blocks do not count)
    num_total_blocks: int = 0
    # a hybrid model's window group (hybrid_kv.py; the counts above are its full group's)
    num_used_window_blocks: int = 0
    num_total_window_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_steps_in_flight: int = 0
    max_steps_in_flight: int = 0     # EngineCore.max_steps_in_flight: 1, 2 or 3 (0: not ready)
    # --max-cpu-loras or runtime updating (core/lora_cache.py; else all 0): adapters loaded
    # on the workers, and the loads and evictions the LRU asked for since the start
    num_loras_loaded: int = 0
    num_lora_loads: int = 0
    num_lora_evictions: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    def num_workers_ready(self, num_workers: int) -> int:
        """Every worker is initialized while the engine is ready, none otherwise."""
        return num_workers if self.ready else 0
