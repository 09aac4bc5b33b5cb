"""The physical floor of a decode step: bytes it must read, and how fast the device moves bytes.

A decode step reads every weight once (the input embedding only for its few rows, unless it is
tied to the LM head, which reads it whole) and every cached key and value of every scheduled
request. Copy bandwidth counts bytes moved: a copy of N bytes reads N and writes N, so it moves 2N.
"""
from __future__ import annotations

import time

import torch

CUDA_COPY_BYTES = 1 << 30      # 1 GiB
CPU_COPY_BYTES = 256 << 20     # 256 MiB: larger than any last-level cache, quick on 2 cores
CUDA_REPEATS = 10
CPU_REPEATS = 5


def weight_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads (shared parameters counted once)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = _untied_input_embedding(model)
    return total - (0 if embed is None else embed.numel() * embed.element_size())


def _untied_input_embedding(model: torch.nn.Module) -> torch.Tensor | None:
    """The input embedding table when it is not also the LM head's weight, else None."""
    if getattr(model, "lm_head_is_tied", True):
        return None
    for name, module in model.named_modules():
        if name.endswith("embed_tokens"):
            return module.weight
    return None


def kv_bytes_per_token(runner) -> int:
    """Bytes of keys and values one cached position takes across all layers of the runner."""
    return runner.kv_block_bytes // runner.block_size


def measure_copy_bandwidth(device: str) -> float:
    """Best observed device-to-same-device copy rate, in bytes moved per second."""
    dev = torch.device(device)
    size = CUDA_COPY_BYTES if dev.type == "cuda" else CPU_COPY_BYTES
    src = torch.ones(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of the pages, kernel load
    if dev.type == "cuda":
        seconds = _time_cuda_copies(src, dst, CUDA_REPEATS)
    else:
        seconds = _time_cpu_copies(src, dst, CPU_REPEATS)
    del src, dst
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * size / seconds


def _time_cuda_copies(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> float:
    """Mean seconds per copy, timed with CUDA events around `repeats` back-to-back copies."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(src.device)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _time_cpu_copies(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> float:
    """Fastest of `repeats` copies, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best
