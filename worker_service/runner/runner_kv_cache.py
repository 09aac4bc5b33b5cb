"""The model runner's KV cache: its size (profiled on CUDA, a byte budget on CPU), allocation,
and the decode CUDA graphs captured over it. A mixin of ModelRunner (model_runner.py), which
sets the attributes used here (model, config, batch, device, lora, staging, ...)."""
from __future__ import annotations

import logging

import torch

from engine_common.request.diff_limits import max_cached_requests
from engine_common.request.kv_groups import WindowGroup, hybrid_window, split_kv_blocks
from engine_common.runtime.progress import heartbeat
from worker_service.batch.diff_check import DiffBounds
from worker_service.models.loader import kv_cache_halves, kv_cache_shape, new_kv_cache
from worker_service.runner.host_memory import zeroed_host_tensor
from worker_service.runner.kv_dtype import kv_cache_dtype, kv_cache_dtype_name
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
    def layer_windows(self) -> tuple[int, ...]:
        """Each cache layer's window (0: none); () when no layer has one or none has a cache."""
        if not self.num_cache_layers:
            return ()
        return tuple(getattr(self.model.args, "layer_windows", ()) or ())

    @property
    def kv_layers(self) -> tuple[int, int, int]:
        """(W, cache layers, layers with W) of a hybrid model (kv_groups.py); (0, 0, 0) else."""
        windows = self.layer_windows
        window, _ = hybrid_window(windows)
        if not window:
            return 0, 0, 0
        return window, len(windows), sum(1 for w in windows if w)

    def kv_split(self, num_blocks: int) -> tuple[int, WindowGroup | None]:
        """(full group's blocks, the window group) of a cache of `num_blocks` blocks of every
        layer (kv_groups.split_kv_blocks): (num_blocks, None) unless the model is hybrid."""
        window, num_layers, num_window_layers = self.kv_layers
        c = self.config
        if c.disable_hybrid_kv_cache_manager:
            return num_blocks, None
        return split_kv_blocks(num_blocks, num_layers, num_window_layers, window,
                               self.block_size, c.max_num_seqs, c.max_num_batched_tokens)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block takes across all layers on this rank (keys and values)."""
        m = self.model
        elem = torch.empty((), dtype=self.cache_dtype).element_size()   # fp8: 1 byte
        return (kv_cache_halves(m) * self.num_cache_layers * self.block_size * m.num_kv_heads
                * m.head_dim * elem)

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's, or fp8 (--kv-cache-dtype, kv_dtype.py)."""
        return kv_cache_dtype(self.config.kv_cache_dtype, self.model_dtype, self.device.type)

    @property
    def cache_dtype_name(self) -> str:
        """The allocated cache's type (before allocation, or without cache layers, the one it
        gets) in --kv-cache-dtype's words (auto, fp8_e4m3, fp8_e5m2): Init's echo."""
        dtype = self.kv_caches[0].dtype if self.kv_caches else self.cache_dtype
        return kv_cache_dtype_name(dtype, self.model_dtype)

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
        num_full, group = self._split_logged(num_blocks)
        self.window_group = group
        windows = self.layer_windows or (0,) * self.num_cache_layers
        self.kv_caches = []
        for window in windows:       # a windowed layer of a hybrid model: its group's pool
            n = group.num_blocks if group is not None and window else num_full
            self.kv_caches.append(new_kv_cache(kv_cache_shape(m, n, self.block_size),
                                               kv_cache_halves(m), self._zeroed))
        if group is not None:
            self.batch.enable_window_group()
        else:
            self.batch.window_table = self.batch.window_num_blocks = None
        self.diff_bounds = DiffBounds(
            num_kv_blocks=num_full, vocab_size=self.vocab_size,
            max_model_len=self.max_model_len, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            block_size=self.block_size, max_blocks_per_request=self.batch.block_table.shape[1],
            max_cached_requests=max_cached_requests(self.config.max_num_seqs),
            num_window_blocks=0 if group is None else group.num_blocks)
        why_not = graphs_unsupported_reason(self.attention_backend_name, self.device,
                                            self.config.enforce_eager, self.model)
        if why_not is None and not self.num_cache_layers:
            why_not = "an encoder model (no KV cache, no decode steps)"
        if why_not is None and group is not None:
            why_not = "a hybrid KV cache (the graphs take one block table)"
        if why_not is None and self.lora is not None:
            why_not = "LoRA adapters are on (the per-row adapter is not a graph input)"
        if why_not is not None:
            log.info("decode CUDA graphs off: %s", why_not)
            return
        self.graph_runner = DecodeGraphRunner(
            self.model, self.kv_caches, self._max_graph_batch, self.batch.block_table.shape[1],
            self.max_model_len, self.device, self.staging)
        self.graph_runner.capture()

    def _zeroed(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed cache tensor (on CPU: resident host pages)."""
        if self.device.type == "cpu":
            return zeroed_host_tensor(shape, self.cache_dtype)
        return torch.zeros(shape, dtype=self.cache_dtype, device=self.device)

    def _split_logged(self, num_blocks: int) -> tuple[int, WindowGroup | None]:
        """kv_split, saying why a model that mixes windowed and full layers keeps one pool."""
        _, why = hybrid_window(self.layer_windows)
        num_full, group = self.kv_split(num_blocks)
        window, _, _ = self.kv_layers
        if why:
            log.info("hybrid KV cache off: %s", why)
        elif window and self.config.disable_hybrid_kv_cache_manager:
            log.info("hybrid KV cache off: --disable-hybrid-kv-cache-manager")
        elif window and group is None:
            log.info("hybrid KV cache off: the cache's %d blocks are fewer than the window "
                     "group alone needs (kv_groups.window_pool_bound); one pool", num_blocks)
        elif group is not None:
            log.info("hybrid KV cache: %d blocks for the full-attention layers, %d for the "
                     "window-%d layers", num_full, group.num_blocks, window)
        return num_full, group

    def free_kv_cache(self) -> None:
        """Drop the cache and the graphs captured over it (they hold its memory and pool)."""
        self.graph_runner = None
        self.kv_caches = []
        self.diff_bounds = None
        self.window_group = None

    @property
    def _max_graph_batch(self) -> int:
        return min(self.config.max_graph_batch, self.config.max_num_seqs)

    def profile_kv_memory(self, gpu_memory_utilization: float) -> KVMemoryProfile:
        """CUDA: what the KV cache may take after a profiled warm-up at the largest step (and
        the largest graphed decode batch), as nano-vllm sizes it. Call with no cache allocated;
        every tensor-parallel rank must call it together (the warm-up runs collectives)."""
        return profile_runner(self, gpu_memory_utilization)
