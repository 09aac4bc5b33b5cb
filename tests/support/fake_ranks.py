"""Fake Ranks (worker_service/ranks/rank_api.py) for NodeWorker tests: no model is loaded, every
step answers b"ok"; the Init checks still read a real (tiny) model directory."""
from __future__ import annotations

from worker_service.config import NodeLayout, RunnerConfig
from worker_service.ranks.rank_api import InitOutcome, StepReply

LAYOUT = NodeLayout()


def runner_config(model_dir: str, **fields) -> RunnerConfig:
    """A small RunnerConfig of `model_dir` (fields override the limits)."""
    limits = dict(max_model_len=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    return RunnerConfig(model_dir=model_dir, **{**limits, **fields})


class FakeRanks:
    """Counts loads and interrupts; every step answers b"ok"."""

    device = "cpu"
    group_id = ""

    def __init__(self):
        self.num_model_loads = 0
        self.interrupts = 0
        self.loaded: RunnerConfig | None = None
        self.steps = 0

    def load(self, config, layout):
        self.num_model_loads += 1
        self.loaded = config
        return InitOutcome(num_kv_blocks=8, kv_block_bytes=64, model_reloaded=True)

    def drop_requests(self):
        return 0

    def run_step(self, payload, verify, output_rank):
        self.steps += 1
        return StepReply(b"ok")

    def interrupt(self):
        self.interrupts += 1

    def readiness(self):
        return (self.loaded is not None, "" if self.loaded else "not initialized")

    def set_failure_listener(self, listener):
        pass

    def describe_devices(self):
        return []

    def model_summary(self):
        return None
