"""What a node's ranks offer the node worker, whichever form they take:

    RunnerKeeper  one rank in the worker service's own process (tp_size 1)
    RankGroup     G rank processes fed over a shared-memory ring (worker_service/ranks/)

The node worker (service/node_worker.py) keeps the epoch, step order and stream rules and calls
these methods; it does not know which form it drives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from engine_common.request.kv_groups import WindowGroup
from worker_service.config import NodeLayout, RunnerConfig
from worker_service.device_info import DeviceDescription


@dataclass(frozen=True)
class InitOutcome:
    num_kv_blocks: int      # the minimum over this node's ranks
    kv_block_bytes: int     # per rank
    model_reloaded: bool
    sliding_window: int = 0   # the window every attention layer has (ModelRunner's), 0: none
    # A hybrid model's window group (engine_common/request/kv_groups.py): num_kv_blocks is then
    # the full group's. Known once the cache is allocated; None before, or for another model.
    window_group: WindowGroup | None = None
    # The KV cache's element type (kv_dtype.kv_cache_dtype_name): InitResponse's echo of it.
    kv_cache_dtype: str = "auto"


def node_kv_cache_dtype(by_rank: list[str]) -> str:
    """The KV cache dtype a node's ranks allocated (each rank's echo, in rank order): every
    rank's, not rank 0's alone, since `fp8` resolves per device kind (kv_dtype.py). ValueError
    naming each rank's when they differ: the node would attend in two precisions."""
    if len(set(by_rank)) > 1:
        raise ValueError(f"the ranks of this node allocated different KV cache dtypes "
                         f"({', '.join(f'rank {i}: {d!r}' for i, d in enumerate(by_rank))}); "
                         "give every rank the same device kind, or name fp8_e4m3 or fp8_e5m2")
    return by_rank[0]


@dataclass(frozen=True)
class RankStepStats:
    """What one step cost one rank, for the worker's metrics: the whole execute and its phases
    (step/step_clock.py) in seconds, and the requests the rank caches after it."""

    global_rank: int
    execute_s: float
    phases: dict[str, float]
    num_requests: int

    def to_wire(self) -> dict:
        return {"rank": self.global_rank, "execute_s": self.execute_s, "phases": self.phases,
                "num_requests": self.num_requests}

    @classmethod
    def from_wire(cls, data: dict) -> "RankStepStats":
        return cls(int(data["rank"]), float(data["execute_s"]), dict(data["phases"]),
                   int(data["num_requests"]))


@dataclass(frozen=True)
class StepReply:
    """One step's answer: the encoded RunnerOutput from the output rank (b"" elsewhere), with
    symmetry verification the digest of the ranks' state (the one they agreed on), and each of
    this node's ranks' step stats."""

    payload: bytes
    digest: bytes | None = None
    ranks: tuple[RankStepStats, ...] = ()


@dataclass(frozen=True)
class ModelSummary:
    """What a worker has loaded, for Info."""

    model_dir: str
    attention_backend: str
    dtype: str              # e.g. "float32"


class Ranks(Protocol):
    """A node's ranks. `load`, `drop_requests` and `run_step` are called under the node worker's
    lock; the introspection methods are not and never wait for it."""

    device: str
    num_model_loads: int

    def load(self, config: RunnerConfig, layout: NodeLayout) -> InitOutcome:
        """Load (or keep) the model, size and allocate the KV cache, drop cached requests."""

    def drop_requests(self) -> int:
        """Drop every cached request; returns how many there were."""

    def run_step(self, payload: bytes, verify: bool, output_rank: bool) -> StepReply:
        """Run one encoded diff; raises StepFailure."""

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Load a LoRA adapter into slot lora_id - 1 on every rank, or on none (a refusal is
        StepFailure INVALID_SETTINGS naming the path)."""

    def unload_lora(self, lora_id: int) -> None:
        """Free that slot on every rank."""

    def interrupt(self) -> None:
        """Make a step that is waiting (for rank replies) give up; before Init and Reset."""

    def close(self) -> None:
        """Release processes and shared memory (the service is stopping)."""

    def set_failure_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(reason)` when the ranks stop being ready on their own (a rank died)."""

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): ready once the model is loaded and its KV cache allocated."""

    def describe_devices(self) -> list[DeviceDescription]:
        """This node's devices, one per local rank."""

    def model_summary(self) -> ModelSummary | None:
        """The loaded model, or None before Init."""

    def pids(self) -> list[int]:
        """The process of each local rank (this process for an in-process rank)."""

    @property
    def group_id(self) -> str:
        """The process group the ranks are in now ("" when none)."""
