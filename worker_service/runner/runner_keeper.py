"""One rank's model runner and KV cache: load or keep, size, allocate, execute.

Used by the in-process InProcessWorker and by every rank process alike. Rules:
- `prepare` keeps a loaded model when the model, dtype, backend, device, lengths and batch sizes
  are unchanged (a restarted scheduler); only the KV budget may differ.
- The block count comes from the KV budget: a byte budget (CPU, or a fixed cache on CUDA), or the
  fraction of the device the rank may use in all, measured on the rank's own device after the
  weights are loaded (CUDA). The caller allocates (possibly fewer: the minimum over ranks).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass

from engine_common.codec import CodecError
from engine_common.diff import RunnerOutput
from worker_service.config import RunnerConfig
from worker_service.runner.model_runner import ModelRunner
from worker_service.failures import FailureKind, StepFailure
from worker_service.parallel_state import TPGroup
from worker_service.runner.step_inputs import StepProtocolError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSummary:
    """What a worker has loaded, for Info."""

    model_dir: str
    attention_backend: str
    dtype: str              # e.g. "float32"


@dataclass(frozen=True)
class Prepared:
    """What `prepare` found: the blocks this rank could hold and whether it (re)loaded."""

    num_kv_blocks: int
    kv_block_bytes: int
    model_reloaded: bool


class RunnerKeeper:
    """Holds one rank's ModelRunner on `device` inside tensor-parallel group `tp`."""

    def __init__(self, device: str, tp: TPGroup | None = None):
        self.device = device
        self.tp = tp
        self.runner: ModelRunner | None = None
        self.num_kv_blocks = 0
        self.num_model_loads = 0

    def prepare(self, config: RunnerConfig, gpu_memory_utilization: float | None) -> Prepared:
        """Load (or keep) the model and measure how many KV blocks this rank can hold."""
        reloaded = not self._can_keep(config)
        if reloaded:
            self._load(config)
        self.runner.config = config  # same load key; records the KV budget now in force
        num_blocks = self._num_blocks(gpu_memory_utilization)
        return Prepared(num_blocks, self.runner.kv_block_bytes, reloaded)

    def allocate(self, num_blocks: int) -> None:
        """Drop cached requests; (re)allocate the KV cache when its size changes."""
        self.runner.reset()
        if num_blocks != self.num_kv_blocks or not self.runner.kv_caches:
            self._free_kv_cache()
            self.runner.init_kv_cache(num_blocks)
            self.num_kv_blocks = num_blocks

    def reset(self) -> int:
        """Drop every cached request; returns how many there were."""
        if self.runner is None:
            return 0
        dropped = len(self.runner.requests)
        self.runner.reset()
        return dropped

    def execute(self, payload: bytes) -> RunnerOutput:
        """Run one encoded diff; every failure becomes a StepFailure of the right kind."""
        try:
            return self.runner.execute(payload)
        except CodecError as e:
            raise StepFailure(FailureKind.BAD_PAYLOAD, str(e)) from e
        except StepProtocolError as e:
            raise StepFailure(FailureKind.BAD_STATE, str(e)) from e
        except Exception as e:  # a model, device or collective failure
            log.exception("step failed")
            raise StepFailure(FailureKind.INTERNAL, f"{type(e).__name__}: {e}") from e

    def summary(self) -> ModelSummary | None:
        r = self.runner
        if r is None:
            return None
        return ModelSummary(r.config.model_dir, r.attention_backend_name,
                            str(r.model_dtype).removeprefix("torch."))

    @property
    def ready(self) -> bool:
        return self.runner is not None and self.num_kv_blocks > 0

    # -- helpers --------------------------------------------------------------------------------

    def _can_keep(self, config: RunnerConfig) -> bool:
        if self.runner is None or not self.runner.kv_caches:
            return False
        budget_free = {"kv_cache_bytes": 1, "num_kv_blocks": None}
        return (dataclasses.replace(self.runner.config, **budget_free)
                == dataclasses.replace(config, **budget_free))

    def _load(self, config: RunnerConfig) -> None:
        self._release()
        log.info("loading model %s on %s", config.model_dir, config.device)
        self.runner = ModelRunner(config, self.tp)
        self.num_model_loads += 1
        log.info("loaded model %s (load #%d, backend %s)", config.model_dir,
                 self.num_model_loads, self.runner.attention_backend_name)

    def _release(self) -> None:
        """Drop the runner and its memory before loading another model."""
        self.runner, self.num_kv_blocks = None, 0
        gc.collect()
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.empty_cache()

    def _num_blocks(self, gpu_memory_utilization: float | None) -> int:
        if gpu_memory_utilization is not None and self.device.startswith("cuda"):
            self._free_kv_cache()  # the current cache does not count as used when profiling
        return self.runner.determine_num_blocks(gpu_memory_utilization)

    def _free_kv_cache(self) -> None:
        self.runner.free_kv_cache()
        self.num_kv_blocks = 0
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.empty_cache()
