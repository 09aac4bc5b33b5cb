"""The worker's configuration, fixed at Init."""
from __future__ import annotations

from dataclasses import dataclass

from engine_common.params import ParamError


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str | None = None            # None or "auto": the model's config decides
    attention_backend: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None    # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # KV budget. On CPU a byte budget; num_kv_blocks, when set, wins (tests use tiny caches).
    kv_cache_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    # Decode CUDA graphs (CUDA with a capturable backend only): captured for batch sizes 1, 2, 4,
    # 8, then steps of 16 up to max_graph_batch; enforce_eager turns them off.
    enforce_eager: bool = False
    max_graph_batch: int = 512
    # Triton kernels for every RMSNorm (incl. the residual form) and the rope
    # (kernels/fused_norm.py, kernels/fused_rope.py): CUDA, or TRITON_INTERPRET=1 on CPU. Off
    # until `python -m bench.fused_ops` and `bench.throughput --fused-ops` show a gain.
    fused_ops: bool = False

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ParamError("block_size", self.block_size, "a power of two >= 1")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes",
                     "max_graph_batch"):
            if getattr(self, name) < 1:
                raise ParamError(name, getattr(self, name), ">= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ParamError("num_kv_blocks", self.num_kv_blocks, ">= 1")
