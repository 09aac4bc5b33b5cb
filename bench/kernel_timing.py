"""What the kernel microbenchmarks share: choosing their device, and timing one call."""
from __future__ import annotations

import os
import time

import torch

from engine_common.request.params import ParamError


def resolve_kernel_bench_device(requested: str) -> str:
    """'cuda' or 'cpu' for --device auto|cpu|cuda. On CPU, Triton kernels run in its interpreter,
    which is read when triton is first imported, so this must run before that."""
    from worker_service.device_info import resolve_device

    device = resolve_device(requested)
    if device == "cuda" and not torch.cuda.is_available():
        raise ParamError("device", device, "'cpu' or 'auto' here: torch sees no CUDA device")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return device


def time_calls(call, device: str, iters: int, warmup: int,
               clock=time.perf_counter) -> list[float]:
    """Seconds per call after `warmup` untimed calls: CUDA events around each call on CUDA,
    `clock` on CPU (perf_counter; time.thread_time counts only this thread's CPU time: the
    whole call with one torch thread, not the waits of a shared machine)."""
    for _ in range(warmup):
        call()
    if device != "cuda":
        seconds = []
        for _ in range(iters):
            t0 = clock()
            call()
            seconds.append(clock() - t0)
        return seconds
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]
