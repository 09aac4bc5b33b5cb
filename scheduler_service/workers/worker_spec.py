"""What the scheduler asks every worker to load (InitSpec) and what Init reports. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from engine_common.params import ParamError

# The rendezvous port on node 0 when there are several nodes: torch.distributed's customary
# MASTER_PORT. Node 0 must have it free; set InitSpec.dist_port (scheduler --dist-port) otherwise.
DEFAULT_DIST_PORT = 29500


@dataclass(frozen=True)
class InitSpec:
    """What every worker loads. 0 / "auto" / None take the worker's or the model's default.

    Exactly one KV budget applies: `kv_cache_bytes` (per rank), or `gpu_memory_utilization` (the
    fraction of each GPU the worker may use in all); neither takes the worker's default.
    """

    model_dir: str
    dtype: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int = 0
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = False      # no decode CUDA graphs
    max_graph_batch: int = 512       # largest decode batch captured as a CUDA graph
    fused_ops: bool = False          # fused Triton RMSNorm and rope (CUDA)
    # Tensor-parallel layout: tp_size = len(addresses) * local ranks per worker. The workers say
    # how many local ranks they run (their --local-ranks); 0 accepts that, any other value must
    # match it. With several nodes the ranks rendezvous at `rendezvous_address`, or when that is
    # "" at node 0's host (from its address) and `dist_port`.
    num_local_ranks: int = 0
    rendezvous_address: str = ""
    dist_port: int = DEFAULT_DIST_PORT
    # Every rank digests its sampled ids and cached state each step; any disagreement (within
    # a node, or between nodes) fails the step with SymmetryError.
    verify_symmetry: bool = False

    def __post_init__(self):
        if not self.model_dir:
            raise ParamError("model_dir", self.model_dir, "a non-empty path")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ParamError("block_size", self.block_size, "a power of two >= 1")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_graph_batch"):
            if getattr(self, name) < 1:
                raise ParamError(name, getattr(self, name), ">= 1")
        if self.num_local_ranks < 0:
            raise ParamError("num_local_ranks", self.num_local_ranks, ">= 0 (0: the workers')")
        if not 1 <= self.dist_port <= 65535:
            raise ParamError("dist_port", self.dist_port, "in [1, 65535]")
        if self.max_model_len < 0:
            raise ParamError("max_model_len", self.max_model_len, ">= 0 (0: the model's)")
        if self.kv_cache_bytes is not None and self.gpu_memory_utilization is not None:
            raise ParamError("gpu_memory_utilization", self.gpu_memory_utilization,
                             "unset when kv_cache_bytes is set (one KV budget)")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ParamError("kv_cache_bytes", self.kv_cache_bytes, ">= 1")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ParamError("gpu_memory_utilization", util, "in (0, 1]")


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


@dataclass(frozen=True)
class WorkerHealth:
    address: str
    ready: bool
    reason: str
