"""KV-cache sizing: the CPU byte budget, the CUDA budget arithmetic, and the warm-up steps.

The warm-up callables run for real on CPU (tiny model, torch backend); measuring memory needs
CUDA and skips without it.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention.torch_ref import TorchAttentionBackend
from worker_service.runner.kv_profiler import (GRAPH_POOL_SLACK_BYTES, KVCacheTooSmall,
                                               KVMemoryProfile, cpu_num_kv_blocks, dummy_batch,
                                               make_decode_warmup, make_prefill_warmup,
                                               measure_peak_bytes, profile_kv_memory, split_evenly)
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group

HAS_CUDA = torch.cuda.is_available()
GIB = 1 << 30


def test_cpu_budget():
    assert cpu_num_kv_blocks(10 * 4096 + 4095, 4096) == 10
    assert cpu_num_kv_blocks(4096, 4096) == 1
    with pytest.raises(KVCacheTooSmall, match="kv_cache_bytes=4095 is less than one KV block"):
        cpu_num_kv_blocks(4095, 4096)
    with pytest.raises(ValueError, match="kv_block_bytes=0"):
        cpu_num_kv_blocks(4096, 0)


def test_cuda_budget_arithmetic():
    prof = KVMemoryProfile(total_bytes=80 * GIB, gpu_memory_utilization=0.9,
                           used_bytes=2 * GIB, peak_activation_bytes=3 * GIB,
                           graph_reserve_bytes=GIB // 2, kv_block_bytes=1 << 20)
    assert prof.budget_bytes == int(72 * GIB) - int(5.5 * GIB)
    assert prof.num_blocks == prof.budget_bytes // (1 << 20) == 66.5 * 1024


def test_cuda_budget_too_small_names_the_numbers():
    prof = KVMemoryProfile(total_bytes=8 * GIB, gpu_memory_utilization=0.5, used_bytes=3 * GIB,
                           peak_activation_bytes=GIB, graph_reserve_bytes=0,
                           kv_block_bytes=1 << 20)
    with pytest.raises(KVCacheTooSmall) as err:
        prof.num_blocks
    text = str(err.value)
    for part in ("gpu_memory_utilization=0.5", "8.00 GiB total", "3.00 GiB used",
                 "1.00 GiB peak activations", f"{1 << 20} bytes"):
        assert part in text


def test_split_evenly():
    assert split_evenly(10, 4) == [3, 3, 2, 2]
    assert split_evenly(3, 5) == [1, 1, 1, 0, 0]
    assert sum(split_evenly(2048, 256)) == 2048


def test_dummy_batch_writes_nothing_and_reads_block_zero():
    ids, pos, meta, last = dummy_batch([3, 1, 5], block_size=4, device="cpu")
    assert ids.tolist() == [0] * 9
    assert pos.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 9]
    assert meta.seq_lens.tolist() == [3, 1, 5]
    assert meta.slot_mapping.tolist() == [-1] * 9
    assert meta.block_table.shape == (3, 2) and not meta.block_table.any()
    assert (meta.max_query_len, meta.max_seq_len) == (5, 5)
    assert last.tolist() == [2, 3, 8]
    _, _, decode, _ = dummy_batch([1, 1], block_size=4, device="cpu", max_seq_len=64)
    assert (decode.max_query_len, decode.max_seq_len) == (1, 64)


@pytest.fixture(scope="module")
def tiny_model(tiny_models):
    return load_model(tiny_models("qwen3"), single_rank_group(), TorchAttentionBackend(), "cpu")


@pytest.mark.parametrize("tokens,seqs,max_len,expected_rows", [
    (64, 8, 32, 8),        # 8 requests of 8 tokens
    (64, 100, 32, 64),     # more sequences than tokens: one token each
    (512, 4, 32, 4),       # capped at 4 x max_model_len tokens
])
def test_prefill_warmup_runs_the_largest_step(tiny_model, tokens, seqs, max_len, expected_rows):
    rows = []
    run = make_prefill_warmup(tiny_model, block_size=4, max_num_batched_tokens=tokens,
                              max_num_seqs=seqs, max_model_len=max_len, device="cpu",
                              sample=lambda logits: rows.append(tuple(logits.shape)))
    run()
    assert rows == [(expected_rows, tiny_model.args.vocab_size)]


def test_decode_warmup_runs(tiny_model):
    make_decode_warmup(tiny_model, block_size=4, batch=6, max_model_len=64, device="cpu")()


@pytest.mark.skipif(not HAS_CUDA, reason="memory profiling needs a CUDA device")
def test_profile_on_cuda(tiny_models):
    model = load_model(tiny_models("qwen3"), single_rank_group(), TorchAttentionBackend(),
                       "cuda")
    held = []
    peak = measure_peak_bytes(lambda: held.append(torch.empty(64 << 20, dtype=torch.uint8,
                                                              device="cuda")), "cuda")
    assert peak >= 64 << 20
    held.clear()
    warm = make_prefill_warmup(model, 16, 256, 8, 64, "cuda")
    graph_warm = make_decode_warmup(model, 16, 8, 64, "cuda")
    prof = profile_kv_memory(warm, 4096, 0.5, "cuda", graph_warm)
    assert prof.peak_activation_bytes > 0
    assert prof.graph_reserve_bytes >= GRAPH_POOL_SLACK_BYTES
    assert 0 < prof.used_bytes < prof.total_bytes
    assert prof.num_blocks > 0
