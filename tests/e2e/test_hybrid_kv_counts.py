"""What a router reads of a hybrid model's KV cache (engine_common/request/kv_groups.py) from
real processes (a CPU worker and a scheduler on loopback, the tiny Gemma 2: window 8 and full
layers alternating): the worker's Info and the scheduler's GetServerStatus both count the full
group's blocks (the pool a request's whole context lives in), not the byte budget's blocks of
every layer they are split from, and the status names the window group's apart."""
from __future__ import annotations

import json

import pytest

from engine_common.request.kv_groups import split_kv_blocks, window_pool_bound
from tests.support.grpc_harness import Processes, server_status, wait_ready, worker_info
from tests.support.ports import free_port

MAX_NUM_SEQS, BLOCK_SIZE, STEP_TOKENS = 4, 16, 64
LIMITS = (BLOCK_SIZE, MAX_NUM_SEQS, STEP_TOKENS)
LAYERS, WINDOW_LAYERS, WINDOW = 4, 2, 8         # tiny Gemma 2


KV_GIB = 0.05


def _budget_blocks(model_dir: str) -> int:
    """The worker's budget in blocks of every layer: --kv-cache-gib over one block's float32
    keys and values of all layers (runner_kv_cache.kv_block_bytes)."""
    cfg = json.load(open(f"{model_dir}/config.json"))
    block_bytes = 2 * LAYERS * BLOCK_SIZE * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    return int(KV_GIB * 2 ** 30) // block_bytes


@pytest.mark.slow
def test_info_and_status_count_the_full_group(tiny_models, tmp_path):
    model = tiny_models("gemma2")
    procs = Processes(tmp_path)
    w_port, s_port = free_port(), free_port()
    worker = procs.worker(w_port)
    sched = procs.scheduler(model, [w_port], s_port, "--kv-cache-gib", str(KV_GIB),
                            "--max-num-seqs", str(MAX_NUM_SEQS), "--block-size",
                            str(BLOCK_SIZE), "--max-num-batched-tokens", str(STEP_TOKENS))
    try:
        wait_ready(f"127.0.0.1:{s_port}", [worker, sched])
        status = server_status(f"127.0.0.1:{s_port}")
        info = worker_info(w_port)
    finally:
        procs.close()
    budget = _budget_blocks(model)
    full, group = split_kv_blocks(budget, LAYERS, WINDOW_LAYERS, WINDOW, *LIMITS)
    assert group is not None and group.num_blocks == window_pool_bound(WINDOW, *LIMITS)
    assert full > budget        # half the layers hold only the window: the rest goes to full
    assert (status.num_kv_blocks, status.num_window_kv_blocks) == (full, group.num_blocks)
    assert info.num_kv_blocks == full and [d.num_kv_blocks for d in info.devices] == [full]
