"""On CUDA, where the offline LLM pipelines its runner (step t+1 launched before step t ends):
generate() returns with nothing held by the runner, and close() (or dropping the last reference)
gives the KV cache and the weights back to torch's allocator. Before, the pipeline's runner
thread held the runner for the life of the process, so `del llm` freed no device memory.
Marked `gpu`; skipped without CUDA. Compared with torch.cuda.memory_allocated() before the LLM,
with room for what torch keeps once used (the cuBLAS workspace)."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

KV_BYTES = 512 << 20
KEPT_BY_TORCH = 64 << 20       # workspaces torch keeps once a kernel used them
JOIN_S = 120.0                 # only a hang reaches it


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _used_llm(tiny_models) -> LLM:
    llm = LLM(tiny_models("qwen3"), device="cuda", kv_cache_bytes=KV_BYTES, max_model_len=256,
              max_num_seqs=8)
    assert llm.runner.pipelined and llm.engine.core.async_scheduling
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(),
                        StoppingParams(max_tokens=8, ignore_eos=True))
    assert [len(c.token_ids) for c in outs] == [8, 8]
    assert llm.runner.requests == {} and llm.runner.batch.num_reqs == 0
    assert llm.engine.core.num_steps_in_flight == 0
    return llm


@pytest.mark.parametrize("how", ["close", "del"])
def test_the_device_memory_goes_back(tiny_models, how):
    before, threads = _allocated(), set(threading.enumerate())
    reserved_before = torch.cuda.memory_reserved()
    llm = _used_llm(tiny_models)
    runner_threads = [t for t in threading.enumerate()
                      if t not in threads and t.name.startswith("runner")]
    assert _allocated() - before >= KV_BYTES // 2     # whole blocks of the budget, and more
    if how == "close":
        llm.close()
    else:
        del llm
        gc.collect()
        for thread in runner_threads:    # ended by the LLM's __del__, without waiting
            thread.join(JOIN_S)
    left = _allocated() - before
    assert left < KEPT_BY_TORCH, f"{left / 2**20:.0f} MiB still allocated after {how}"
    if how == "close":      # and torch's cache gives it back to the device
        assert torch.cuda.memory_reserved() - reserved_before < KEPT_BY_TORCH
