"""What the scheduler asks every worker to load (InitSpec) and what Init reports. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from engine_common.configuration.config import WorkerConfig
from engine_common.request.kv_groups import WindowGroup
from engine_common.request.params import ParamError

# The rendezvous port on node 0 when there are several nodes: torch.distributed's customary
# MASTER_PORT. Node 0 must have it free; set InitSpec.dist_port (scheduler --dist-port) otherwise.
DEFAULT_DIST_PORT = 29500


@dataclass(frozen=True)
class InitSpec:
    """What every worker loads (`config`) and how the workers form one tensor-parallel group.

    tp_size = len(addresses) * local ranks per worker. The workers say how many local ranks they
    run (their --local-ranks); num_local_ranks 0 accepts that, any other value must match it.
    With several nodes the ranks rendezvous at `rendezvous_address`, or when that is "" at node
    0's host (from its address) and `dist_port`.
    """

    config: WorkerConfig
    num_local_ranks: int = 0
    rendezvous_address: str = ""
    dist_port: int = DEFAULT_DIST_PORT

    def __post_init__(self):
        if self.num_local_ranks < 0:
            raise ParamError("num_local_ranks", self.num_local_ranks, ">= 0 (0: the workers')")
        if not 1 <= self.dist_port <= 65535:
            raise ParamError("dist_port", self.dist_port, "in [1, 65535]")


@dataclass(frozen=True)
class WorkerDevice:
    """One rank's device as a worker reported it in Init."""

    address: str
    node_rank: int
    local_rank: int
    global_rank: int
    kind: str
    name: str
    total_memory_bytes: int
    free_memory_bytes: int
    num_kv_blocks: int


@dataclass(frozen=True)
class InitResult:
    epoch: int
    num_kv_blocks: int      # the minimum over all workers
    kv_block_bytes: int     # per rank
    devices: tuple[WorkerDevice, ...]
    tp_size: int = 1
    group_id: str = ""
    # The window every attention layer of the model has (0: none), by which the scheduler
    # frees KV blocks: 0 when a worker reports none (an older one), else the largest.
    sliding_window: int = 0
    # A hybrid model's window group (engine_common/request/kv_groups.py); num_kv_blocks is then
    # the full group's. None for any other model.
    window_group: WindowGroup | None = None
    # The KV cache's element type the workers allocated (init_messages.allocated_kv_cache_dtype:
    # auto, fp8_e4m3 or fp8_e5m2).
    kv_cache_dtype: str = "auto"
    # Every node launches step t+1 before step t is finished (InitResponse.pipelined): the
    # engine may keep three steps in flight (engine_core.py).
    pipelined: bool = False


@dataclass(frozen=True)
class WorkerHealth:
    address: str
    ready: bool
    reason: str
    epoch: int = 0              # the worker's epoch and owner (fencing)
    scheduler_id: str = ""
