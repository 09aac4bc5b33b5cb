"""The model runner's KV cache: its size (profiled on CUDA, a byte budget on CPU), allocation,
and the decode CUDA graphs captured over it. A mixin of ModelRunner (model_runner.py), which
sets the attributes used here (model, config, batch, device, lora, staging, ...)."""
from __future__ import annotations

import logging

import torch

from engine_common.request.diff_limits import max_cached_requests
from engine_common.runtime.progress import heartbeat
from worker_service.batch.diff_check import DiffBounds
from worker_service.runner.host_memory import zeroed_host_tensor
from worker_service.runner.kv_profiler import KVMemoryProfile, cpu_num_kv_blocks
from worker_service.runner.runner_profile import profile_runner
from worker_service.step.cuda_graphs import DecodeGraphRunner, graphs_unsupported_reason

log = logging.getLogger(__name__)


class RunnerKVCache:
    """KV cache methods of ModelRunner."""

    @property
    def num_cache_layers(self) -> int:
        """Layers that keep a KV cache: none for an encoder (models/bert.py)."""
        return self.model.num_layers if getattr(self.model, "needs_kv_cache", True) else 0

    @property
    def sliding_window(self) -> int:
        """The window every attention layer has (DecoderArgs.shared_window; 0: none, or no KV
        cache), which the scheduler frees KV blocks by."""
        return self.model.args.shared_window() if self.num_cache_layers else 0

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block takes across all layers on this rank (keys and values)."""
        m = self.model
        elem = torch.empty((), dtype=self.model_dtype).element_size()
        return 2 * self.num_cache_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def determine_num_blocks(self) -> int:
        """KV blocks this rank can hold: num_kv_blocks when set; on CUDA with a utilization, a
        profiled share of the device (call with no cache allocated); else the byte budget."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if not self.num_cache_layers:     # blocks are bookkeeping only: a full-length seat each
            return config.max_num_seqs * self.batch.block_table.shape[1]
        if config.gpu_memory_utilization is None or self.device.type != "cuda":
            return cpu_num_kv_blocks(config.kv_budget_bytes, self.kv_block_bytes)
        with heartbeat(f"profiling KV memory on {self.device} with a warm-up step of "
                       f"{config.max_num_batched_tokens} tokens", emit=log.info):
            profile = self.profile_kv_memory(config.gpu_memory_utilization)
        log.info("KV memory on %s: %s", self.device, profile)
        return profile.num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache, then capture decode CUDA graphs over it where they apply."""
        self.free_kv_cache()
        m = self.model
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        if self.device.type == "cpu":
            self.kv_caches = [zeroed_host_tensor(shape, self.model_dtype)
                              for _ in range(self.num_cache_layers)]
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.model_dtype, device=self.device)
                              for _ in range(self.num_cache_layers)]
        self.diff_bounds = DiffBounds(
            num_kv_blocks=num_blocks, vocab_size=self.vocab_size,
            max_model_len=self.max_model_len, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            block_size=self.block_size, max_blocks_per_request=self.batch.block_table.shape[1],
            max_cached_requests=max_cached_requests(self.config.max_num_seqs))
        why_not = graphs_unsupported_reason(self.attention_backend_name, self.device,
                                            self.config.enforce_eager, self.model)
        if why_not is None and not self.num_cache_layers:
            why_not = "an encoder model (no KV cache, no decode steps)"
        if why_not is None and self.lora is not None:
            why_not = "LoRA adapters are on (the per-row adapter is not a graph input)"
        if why_not is not None:
            log.info("decode CUDA graphs off: %s", why_not)
            return
        self.graph_runner = DecodeGraphRunner(
            self.model, self.kv_caches, self._max_graph_batch, self.batch.block_table.shape[1],
            self.max_model_len, self.device, self.staging)
        self.graph_runner.capture()

    def free_kv_cache(self) -> None:
        """Drop the cache and the graphs captured over it (they hold its memory and pool)."""
        self.graph_runner = None
        self.kv_caches = []
        self.diff_bounds = None

    @property
    def _max_graph_batch(self) -> int:
        return min(self.config.max_graph_batch, self.config.max_num_seqs)

    def profile_kv_memory(self, gpu_memory_utilization: float) -> KVMemoryProfile:
        """CUDA: what the KV cache may take after a profiled warm-up at the largest step (and
        the largest graphed decode batch), as nano-vllm sizes it. Call with no cache allocated;
        every tensor-parallel rank must call it together (the warm-up runs collectives)."""
        return profile_runner(self, gpu_memory_utilization)
