"""How many KV-cache blocks fit: on CUDA from a profiled warm-up, on CPU from a byte budget.

CUDA (bytes; measured after a warm-up forward at the largest step the scheduler can send):

    budget = total * gpu_memory_utilization
             - used              total - free once the warm-up is released: weights, CUDA
                                 context, NCCL buffers, other processes on the device
             - peak_activation   peak allocated during the warm-up minus allocated before it
             - graph_reserve     CUDA graphs' private pool: peak of a decode warm-up at
                                 max_graph_batch (+ slack for capture workspaces); 0 when eager
             - lora_reserve      the LoRA stacks the flags allow (lora_memory.py) less those
                                 allocated already (counted in `used`): adapters loaded later
    num_blocks = budget // kv_block_bytes          (an error, naming every number, when < 1)

The warm-up is a prefill of max_num_batched_tokens tokens split into max_num_seqs requests over a
one-block temporary cache: every slot is -1 (nothing is written) and every block-table entry is
0, so attention reads stay in bounds while doing the full step's work. The LM head runs on each
request's last token (max_num_seqs rows of logits) and, when given, the sampler on those.

The profiling functions take plain callables and sizes, so they do not depend on the runner.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from kernels.attention.backend import AttentionMetadata

GRAPH_POOL_SLACK_BYTES = 64 << 20     # cuBLAS workspaces etc. created for the capture stream


class KVCacheTooSmall(MemoryError):
    """The memory budget leaves room for no KV-cache block."""


@dataclass(frozen=True)
class KVMemoryProfile:
    """The numbers behind a CUDA KV-cache size (bytes), kept for logs and Info."""

    total_bytes: int
    gpu_memory_utilization: float
    used_bytes: int
    peak_activation_bytes: int
    graph_reserve_bytes: int
    kv_block_bytes: int
    lora_reserve_bytes: int = 0
    lora_flags: str = "the LoRA flags"     # where the stacks' size comes from (lora_memory.py)

    @property
    def budget_bytes(self) -> int:
        return (int(self.total_bytes * self.gpu_memory_utilization) - self.used_bytes
                - self.peak_activation_bytes - self.graph_reserve_bytes
                - self.lora_reserve_bytes)

    @property
    def num_blocks(self) -> int:
        """Blocks that fit in the budget; raises KVCacheTooSmall when none does."""
        blocks = max(self.budget_bytes, 0) // self.kv_block_bytes
        if blocks < 1:
            gib = 1 << 30
            lora = (f" - {self.lora_reserve_bytes / gib:.2f} GiB LoRA stacks to come "
                    f"({self.lora_flags})" if self.lora_reserve_bytes else "")
            raise KVCacheTooSmall(
                f"gpu_memory_utilization={self.gpu_memory_utilization} leaves no room for the "
                f"KV cache: {self.gpu_memory_utilization} x {self.total_bytes / gib:.2f} GiB "
                f"total - {self.used_bytes / gib:.2f} GiB used (weights, context, others) - "
                f"{self.peak_activation_bytes / gib:.2f} GiB peak activations - "
                f"{self.graph_reserve_bytes / gib:.2f} GiB CUDA-graph pool{lora} = "
                f"{self.budget_bytes / gib:.3f} GiB; one block needs {self.kv_block_bytes} "
                "bytes. Raise gpu_memory_utilization, or lower max_num_batched_tokens, "
                "max_num_seqs or max_graph_batch")
        return blocks


def cpu_num_kv_blocks(kv_cache_bytes: int, kv_block_bytes: int) -> int:
    """Blocks in a CPU byte budget (--kv-cache-gib); raises KVCacheTooSmall below one block."""
    if kv_block_bytes < 1:
        raise ValueError(f"kv_block_bytes={kv_block_bytes} is invalid: must be >= 1")
    if kv_cache_bytes < kv_block_bytes:
        raise KVCacheTooSmall(f"kv_cache_bytes={kv_cache_bytes} is less than one KV block "
                              f"({kv_block_bytes} bytes)")
    return kv_cache_bytes // kv_block_bytes


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str) -> int:
    """Peak bytes allocated on `device` while fn runs, above what was allocated before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def profile_kv_memory(run_warmup: Callable[[], Any], kv_block_bytes: int,
                      gpu_memory_utilization: float, device: torch.device | str,
                      run_graph_warmup: Callable[[], Any] | None = None,
                      lora_reserve_bytes: int = 0,
                      lora_flags: str = "the LoRA flags") -> KVMemoryProfile:
    """Run the warm-up(s), release their memory, and measure what the KV cache may take,
    leaving lora_reserve_bytes free (`lora_flags`: the flags that set it, for the error). Call it with the weights loaded and no KV cache
    allocated."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} is invalid: "
                         "must be in (0, 1]")
    _release(device)
    peak = measure_peak_bytes(run_warmup, device)
    graph_reserve = 0
    if run_graph_warmup is not None:
        graph_reserve = measure_peak_bytes(run_graph_warmup, device) + GRAPH_POOL_SLACK_BYTES
    _release(device)
    free, total = torch.cuda.mem_get_info(device)
    return KVMemoryProfile(int(total), gpu_memory_utilization, int(total - free), peak,
                           graph_reserve, kv_block_bytes, lora_reserve_bytes, lora_flags)


def _release(device: torch.device | str) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


# -- the warm-up steps ---------------------------------------------------------------------------

def split_evenly(total: int, parts: int) -> list[int]:
    """`parts` non-negative ints summing to `total`, differing by at most one."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def dummy_batch(query_lens: list[int], block_size: int, device: torch.device | str,
                max_seq_len: int | None = None):
    """(input_ids, positions, metadata, last_rows) for fresh requests of query_lens tokens over
    a one-block cache: slots -1, block table all 0. max_seq_len overrides the metadata's bound
    (decode warm-ups pass max_model_len, as graph capture does)."""
    lens = torch.tensor(query_lens, dtype=torch.int32)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=starts[1:])
    num_tokens = int(starts[-1])
    positions = torch.cat([torch.arange(n) for n in query_lens])
    max_len = max(query_lens)
    meta = AttentionMetadata(
        num_reqs=len(query_lens), num_actual_tokens=num_tokens, max_query_len=max_len,
        max_seq_len=max_seq_len or max_len, query_start_loc=starts.to(device),
        seq_lens=lens.to(device),
        block_table=torch.zeros(len(query_lens), -(-max_len // block_size), dtype=torch.int32,
                                device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc_cpu=starts, seq_lens_cpu=lens)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    last_rows = (starts[1:] - 1).to(torch.int64).to(device)
    return input_ids, positions.to(device), meta, last_rows


def make_prefill_warmup(model: nn.Module, block_size: int, max_num_batched_tokens: int,
                        max_num_seqs: int, max_model_len: int, device: torch.device | str,
                        sample: Callable[[torch.Tensor], Any] | None = None
                        ) -> Callable[[], None]:
    """The profiling step: max_num_batched_tokens prompt tokens over min(max_num_seqs, tokens)
    requests (each at most max_model_len), then the LM head (and `sample`) on their last rows."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    total = min(max_num_batched_tokens, num_seqs * max_model_len)
    query_lens = [n for n in split_evenly(total, num_seqs) if n > 0]

    @torch.inference_mode()
    def run() -> None:
        caches = _one_block_caches(model, block_size, device)
        input_ids, positions, meta, last_rows = dummy_batch(query_lens, block_size, device)
        hidden = model(input_ids, positions, caches, meta)
        logits = model.compute_logits(hidden[last_rows])
        if sample is not None:
            sample(logits)
    return run


def make_decode_warmup(model: nn.Module, block_size: int, batch: int, max_model_len: int,
                       device: torch.device | str) -> Callable[[], None]:
    """A decode step of `batch` one-token requests (what the largest CUDA graph captures)."""

    @torch.inference_mode()
    def run() -> None:
        caches = _one_block_caches(model, block_size, device)
        input_ids, positions, meta, _ = dummy_batch([1] * batch, block_size, device,
                                                    max_seq_len=max_model_len)
        model(input_ids, positions, caches, meta)
    return run


def _one_block_caches(model: nn.Module, block_size: int,
                      device: torch.device | str) -> list[torch.Tensor]:
    shape = (2, 1, block_size, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape, dtype=model.dtype, device=device)
            for _ in range(model.num_layers)]
