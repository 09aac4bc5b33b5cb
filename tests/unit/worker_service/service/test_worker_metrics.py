"""WorkerMetrics over a real NodeWorker: the step listener feeds the step histograms per rank,
and a scrape reads requests cached, KV blocks, the process figures and (with a stand-in NVML
module injected at the boundary: there is no GPU here) the GPU gauges, labelled by rank and
device; on a CPU worker, or without NVML, there are no GPU series."""
from __future__ import annotations

import os
import sys

from tests.support.fake_nvml import fake_nvml
from worker_service.config import NodeLayout, RunnerConfig
from worker_service.ranks.rank_api import ModelSummary, RankStepStats, StepReply
from worker_service.ranks.runner_keeper import RunnerKeeper
from worker_service.service.node_worker import NodeWorker
from worker_service.service.worker_metrics import WorkerMetrics
from tests.support.fake_ranks import FakeRanks


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value("deltaserve:worker_" + name, labels)


def test_step_stats_feed_the_histograms_of_each_rank():
    node = NodeWorker(RunnerKeeper("cpu"), NodeLayout())
    metrics = WorkerMetrics(node)
    for n in (3, 2):
        metrics.observe_step(StepReply(b"", None, (RankStepStats(
            0, 0.02, {"input_prep": 0.001, "forward": 0.015, "sampling": 0.002,
                      "readback": 0.001}, n),)))
    cpu = {"rank": "0", "device": "cpu"}
    assert value(metrics, "steps_total", **cpu) == 2
    assert value(metrics, "step_execute_seconds_count", **cpu) == 2
    assert abs(value(metrics, "step_phase_seconds_sum", phase="forward", **cpu) - 0.03) < 1e-9
    assert value(metrics, "requests_cached", **cpu) == 0      # no epoch: nothing is cached
    assert value(metrics, "kv_blocks", **cpu) == 0                  # not initialized yet
    assert value(metrics, "process_cpu_seconds_total", **cpu) > 0
    assert value(metrics, "process_resident_memory_bytes", **cpu) > 0
    assert value(metrics, "gpu_utilization_ratio", **cpu) is None


def test_gpu_gauges_come_from_nvml_per_rank_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    node = NodeWorker(RunnerKeeper("cuda"), NodeLayout(tp_size=4, node_rank=1, num_nodes=4))
    metrics = WorkerMetrics(node, nvml=fake_nvml())
    gpu = {"rank": "1", "device": "cuda:0"}                       # node 1's only rank
    assert value(metrics, "gpu_utilization_ratio", **gpu) == 0.87
    assert value(metrics, "gpu_memory_used_bytes", **gpu) == 3 << 30
    assert value(metrics, "gpu_memory_total_bytes", **gpu) == 80 << 30
    assert value(metrics, "gpu_power_watts", **gpu) == 250.5
    assert value(metrics, "gpu_temperature_celsius", **gpu) == 61
    assert value(metrics, "gpu_sm_clock_hertz", **gpu) == 1980e6
    assert metrics.device_of(1) == "cuda:0"


def test_without_nvml_a_cuda_worker_still_scrapes(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    node = NodeWorker(RunnerKeeper("cuda:1"), NodeLayout())
    metrics = WorkerMetrics(node)
    labels = {"rank": "0", "device": "cuda:1"}
    assert value(metrics, "gpu_utilization_ratio", **labels) is None
    assert value(metrics, "kv_blocks", **labels) == 0
    assert value(metrics, "process_resident_memory_bytes", **labels) > 0


class _StatsRanks(FakeRanks):
    """Ranks that load at once and report `cached` requests after every step; `loaded = False`
    stands for ranks that died."""

    def __init__(self):
        super().__init__()
        self.cached = 0

    def drop_requests(self):
        return self.cached

    def run_step(self, payload, verify, output_rank):
        return StepReply(b"", None, (RankStepStats(0, 0.01, {}, self.cached),))

    def readiness(self):
        return (True, "") if self.loaded else (False, "not initialized")

    def model_summary(self):
        return ModelSummary("m", "torch", "float32") if self.loaded else None

    def pids(self):
        return [os.getpid()]


def test_requests_cached_is_not_the_last_epochs_after_init_reset_or_a_rank_death(tiny_models):
    """Init and Reset drop every cached request (the worker holds none until the next step):
    the gauge must not keep saying what the old epoch's last step held, e.g. while a restarted
    scheduler has no traffic yet. A worker whose ranks died holds neither requests nor KV."""
    ranks = _StatsRanks()
    node = NodeWorker(ranks, NodeLayout())
    metrics = WorkerMetrics(node)
    node.step_listener = metrics.observe_step
    config = RunnerConfig(model_dir=tiny_models("qwen3"), max_model_len=64, block_size=4,
                          max_num_seqs=4, max_num_batched_tokens=64)
    cpu = {"rank": "0", "device": "cpu"}
    node.init(config, NodeLayout(), epoch=1, owner="A")
    ranks.cached = 3
    node.step(node.open_stream(node.stream_key(node.epoch)), 1, 0, b"")
    assert value(metrics, "requests_cached", **cpu) == 3
    assert value(metrics, "kv_blocks", **cpu) == 8
    node.init(config, NodeLayout(), epoch=2, owner="B")        # a restarted scheduler
    assert value(metrics, "requests_cached", **cpu) == 0
    node.step(node.open_stream(node.stream_key(node.epoch)), 2, 0, b"")
    assert value(metrics, "requests_cached", **cpu) == 3
    node.reset(3, "B", node.stream_key(2))
    assert value(metrics, "requests_cached", **cpu) == 0
    node.step(node.open_stream(node.stream_key(node.epoch)), 3, 0, b"")
    ranks.loaded = False                                       # the ranks died
    assert value(metrics, "requests_cached", **cpu) == 0
    assert value(metrics, "kv_blocks", **cpu) == 0
