"""On CUDA: once the KV cache is allocated, a step of the whole token budget finds its
activation memory already held by the caching allocator.

Profiling the KV memory ends with torch.cuda.empty_cache(), so without a warm-up after the cache
is allocated the first full-budget prefill of a run asks the driver for fresh memory (an H100
run's first 16K-token step took 94 ms against ~53 for the next full steps). ModelRunner.
init_kv_cache runs that step once; this checks the allocator reserves nothing more when the same
largest step runs again. Marked `gpu`; skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from worker_service.config import RunnerConfig
from worker_service.runner.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_largest_step_needs_no_new_device_memory(tiny_models):
    runner = ModelRunner(RunnerConfig(
        model_dir=tiny_models("qwen3", intermediate_size=512), device="cuda", dtype="bfloat16",
        attention_backend="triton", block_size=16, max_model_len=512, max_num_seqs=16,
        max_num_batched_tokens=4096, num_kv_blocks=64))
    # a profiled run's state: the allocator emptied before the cache is allocated
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    runner.init_kv_cache(64)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    runner.largest_step_warmup()()
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
