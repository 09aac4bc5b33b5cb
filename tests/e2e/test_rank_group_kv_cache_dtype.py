"""Two real rank processes (gloo on CPU) behind a RankGroup: the node's Init outcome carries the
KV cache dtype the ranks allocated, gathered from every rank (rank_api.node_kv_cache_dtype)."""
from __future__ import annotations

import dataclasses

from worker_service.config import NodeLayout, RunnerConfig
from worker_service.ranks.rank_group import RankGroup, RankGroupOptions
from worker_service.service.node_worker import NodeWorker


def test_both_ranks_allocate_and_echo_the_resolved_fp8(tiny_models):
    layout = NodeLayout(tp_size=2, num_local_ranks=2)
    worker = NodeWorker(RankGroup("cpu", layout, RankGroupOptions()), layout)
    config = RunnerConfig(model_dir=tiny_models("qwen3"), num_kv_blocks=32, max_num_seqs=4,
                          max_num_batched_tokens=64, kv_cache_dtype="fp8")
    try:
        outcome = worker.init(config, layout, epoch=1)
        assert outcome.kv_cache_dtype == "fp8_e5m2"            # plain fp8 on the CPU
        auto = worker.init(dataclasses.replace(config, kv_cache_dtype="auto"), layout, epoch=2)
        assert auto.kv_cache_dtype == "auto"
    finally:
        worker.close()
