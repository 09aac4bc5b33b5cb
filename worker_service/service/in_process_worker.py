"""The single-rank worker: one ModelRunner in the worker service's own process (tp_size 1).

The tensor-parallel flavour, `RankGroupWorker` (rank_group_worker.py), offers the same methods, so the
servicer does not care which one it drives. Epoch, step order and stream rules: node_worker.py.
Model keeping and KV sizing: runner_keeper.py.
"""
from __future__ import annotations

import logging

from engine_common.codec import encode_runner_output
from worker_service.config import RunnerConfig
from worker_service.device_info import DeviceDescription, describe_device
from worker_service.runner.runner_keeper import ModelSummary, RunnerKeeper
from worker_service.service.node_worker import InitOutcome, NodeLayout, NodeWorker, StepReply

log = logging.getLogger(__name__)


class InProcessWorker(NodeWorker):
    """A worker service's state for one in-process rank on `device`."""

    def __init__(self, device: str = "cpu", layout: NodeLayout = NodeLayout()):
        if layout.tp_size != 1:
            raise ValueError(f"tp_size={layout.tp_size} is invalid for an in-process worker: "
                             "must be 1 (use RankGroupWorker)")
        super().__init__(device, layout)
        self.host = RunnerKeeper(device)

    @property
    def runner(self):
        return self.host.runner

    @property
    def num_model_loads(self) -> int:
        return self.host.num_model_loads

    def _load(self, config: RunnerConfig, layout: NodeLayout,
              gpu_memory_utilization: float | None) -> InitOutcome:
        prepared = self.host.prepare(config, gpu_memory_utilization)
        self.host.allocate(prepared.num_kv_blocks)
        return InitOutcome(prepared.num_kv_blocks, prepared.kv_block_bytes,
                           prepared.model_reloaded)

    def _drop_requests(self) -> int:
        return self.host.reset()

    def _execute(self, payload: bytes) -> StepReply:
        out = self.host.execute(payload)
        digest = self.host.runner.state_digest(out) if self.verify_symmetry else None
        data = encode_runner_output(out) if self.layout.node_rank == 0 else b""
        return StepReply(data, digest)

    # -- introspection (no lock: never waits behind a step or a model load) ----------------------

    def readiness(self) -> tuple[bool, str]:
        if self.host.runner is None:
            return False, "not initialized"
        if self.host.num_kv_blocks == 0:
            return False, "KV cache not allocated"
        return True, ""

    def describe_devices(self) -> list[DeviceDescription]:
        return [describe_device(self.device)]

    def model_summary(self) -> ModelSummary | None:
        return self.host.summary()
