"""One rank's runner configuration: what Init sent (WorkerConfig) plus where the rank runs."""
from __future__ import annotations

from dataclasses import dataclass

from engine_common.configuration.config import WorkerConfig
from engine_common.request.params import ParamError


@dataclass(frozen=True, kw_only=True)
class RunnerConfig(WorkerConfig):
    """WorkerConfig + the rank's device (and, for host benchmarks, a simulated one). num_kv_blocks, when set, fixes the KV cache size and
    wins over every budget (tests and benchmarks use tiny caches)."""

    device: str = "cpu"
    num_kv_blocks: int | None = None
    # Benchmarks of the host's work only (bench/host_overhead.py): no forward pass or sampler,
    # each step takes this long on a simulated device (runner/simulated_device.py).
    simulated_device_ms: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ParamError("num_kv_blocks", self.num_kv_blocks, ">= 1")
        if self.simulated_device_ms is not None and not self.simulated_device_ms >= 0:
            raise ParamError("simulated_device_ms", self.simulated_device_ms, ">= 0")


def rank_device(device: str, local_rank: int) -> str:
    """The device of local rank `local_rank` of a worker started on `device`: with the kind only
    ("cuda"), rank r uses cuda:r; a named device ("cuda:1", "cpu") is used as it is."""
    if device.startswith("cuda") and ":" not in device:
        return f"cuda:{local_rank}"
    return device


@dataclass(frozen=True)
class NodeLayout:
    """This node's place in the tensor-parallel group (see ParallelLayout in worker.proto)."""

    tp_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    num_local_ranks: int = 1
    rendezvous_address: str = ""
    group_id: str = ""

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.num_local_ranks + local_rank
