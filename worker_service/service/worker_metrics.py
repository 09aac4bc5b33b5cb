"""The worker's Prometheus metrics, prefix `deltaserve:worker_`, every series labelled by the
rank (global rank) and its device ("cpu", "cuda:N").

    steps, step execute and phase seconds     recorded after each step, from every local rank's
                                              RankStepStats (step/step_clock.py's phases)
    requests cached, KV blocks                read at scrape time from the node worker (0 once
                                              Init or Reset dropped the requests or the ranks
                                              died: never the last epoch's figure)
    process CPU seconds and resident memory   read at scrape time from /proc, per rank process
    GPU utilization, memory, power,           read at scrape time from NVML, per CUDA rank
    temperature and SM clock                  (device_telemetry.py)

docs/metrics.md ("The metrics, name by name") lists every name.
"""
from __future__ import annotations

from types import ModuleType

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from worker_service.config import rank_device
from worker_service.ranks.rank_api import StepReply
from worker_service.service.device_telemetry import NvmlReader, read_process
from worker_service.service.node_worker import NodeWorker

PREFIX = "deltaserve:worker_"
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                        0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LABELS = ["rank", "device"]
_GPU_GAUGES = (   # (name, GpuReading field, help)
    ("gpu_utilization_ratio", "utilization", "GPU busy time over the last sample period, 0-1."),
    ("gpu_memory_used_bytes", "memory_used_bytes", "GPU memory in use (all processes)."),
    ("gpu_memory_total_bytes", "memory_total_bytes", "GPU memory in all."),
    ("gpu_power_watts", "power_watts", "GPU board power draw."),
    ("gpu_temperature_celsius", "temperature_celsius", "GPU core temperature."),
    ("gpu_sm_clock_hertz", "sm_clock_hertz", "GPU SM clock."),
)


class WorkerMetrics:
    """Every worker metric in its own registry. `nvml` is passed on to NvmlReader."""

    def __init__(self, node: NodeWorker, nvml: ModuleType | None = None):
        self.registry = CollectorRegistry()
        self._node = node
        # global rank -> (epoch, requests cached after that epoch's last step)
        self._requests: dict[int, tuple[int | None, int]] = {}
        self.steps = Counter(PREFIX + "steps", "Steps the rank ran.", _LABELS,
                             registry=self.registry)
        self.execute = Histogram(PREFIX + "step_execute_seconds", "Seconds of one step on the "
                                 "rank: decode the diff, run it, encode the reply.", _LABELS,
                                 buckets=STEP_SECONDS_BUCKETS, registry=self.registry)
        self.phase = Histogram(PREFIX + "step_phase_seconds", "Seconds of one step on the rank "
                               "by phase: input_prep, forward, sampling, readback (host time; "
                               "on CUDA the device time shows in readback).", _LABELS + ["phase"],
                               buckets=STEP_SECONDS_BUCKETS, registry=self.registry)
        self.registry.register(_NodeCollector(node, self._requests, NvmlReader(nvml)))

    def observe_step(self, reply: StepReply) -> None:
        """Record every local rank's stats of one step (NodeWorker's step listener)."""
        for stats in reply.ranks:
            labels = (str(stats.global_rank), self.device_of(stats.global_rank))
            self.steps.labels(*labels).inc()
            self.execute.labels(*labels).observe(stats.execute_s)
            for phase, seconds in stats.phases.items():
                self.phase.labels(*labels, phase).observe(seconds)
            self._requests[stats.global_rank] = (self._node.epoch, stats.num_requests)

    def device_of(self, global_rank: int) -> str:
        layout = self._node.started_layout
        return rank_device(self._node.device, global_rank - layout.global_rank(0))


class _NodeCollector:
    """The gauges and counters read at scrape time, one series per local rank."""

    def __init__(self, node: NodeWorker, requests: dict[int, int], nvml: NvmlReader):
        self._node = node
        self._requests = requests
        self._nvml = nvml

    def collect(self):
        node, layout = self._node, self._node.started_layout
        ranks = [(str(layout.global_rank(r)), rank_device(node.device, r))
                 for r in range(layout.num_local_ranks)]
        # Init and Reset drop every cached request and a dead rank holds none: a figure of an
        # earlier epoch, or of ranks that are gone, is 0 (as Info reports no KV blocks then).
        ready = node.readiness()[0]
        epoch = node.epoch
        yield _gauges("requests_cached", "Requests the rank holds in its persistent batch "
                      "after its last step.",
                      [(labels, self._cached(int(labels[0]), epoch, ready)) for labels in ranks])
        blocks = node.num_kv_blocks if node.model_summary() is not None else 0
        yield _gauges("kv_blocks", "KV-cache blocks allocated on the rank's device.",
                      [(labels, blocks) for labels in ranks])
        yield from self._processes(ranks)
        readings = [(labels, self._nvml.read(labels[1])) for labels in ranks]
        for name, field, doc in _GPU_GAUGES:    # only where a GPU answered
            family = _gauges(name, doc, [(labels, getattr(r, field)) for labels, r in readings
                                         if r is not None and getattr(r, field) is not None])
            if family.samples:
                yield family

    def _cached(self, global_rank: int, epoch: int | None, ready: bool) -> int:
        seen_epoch, count = self._requests.get(global_rank, (None, 0))
        return count if ready and seen_epoch is not None and seen_epoch == epoch else 0

    def _processes(self, ranks):
        pids = self._node.ranks.pids()
        readings = [(labels, read_process(pid)) for labels, pid in zip(ranks, pids)]
        readings = [(labels, r) for labels, r in readings if r is not None]
        cpu = CounterMetricFamily(PREFIX + "process_cpu_seconds", "CPU seconds (user + "
                                  "system) of the rank's process.", labels=_LABELS)
        for labels, r in readings:
            cpu.add_metric(list(labels), r.cpu_seconds)
        yield cpu
        yield _gauges("process_resident_memory_bytes", "Resident memory of the rank's process.",
                      [(labels, r.resident_bytes) for labels, r in readings])


def _gauges(name: str, doc: str, samples) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=_LABELS)
    for labels, value in samples:
        family.add_metric(list(labels), value)
    return family
