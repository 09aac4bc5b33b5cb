"""One rank's model runner and KV cache: load or keep, size, allocate, run steps.

Every rank process keeps one; a worker service with a single rank in all uses one directly as
its Ranks (rank_api.py). Rules:
- `prepare` keeps a loaded model when the model, dtype, backend, device, lengths and batch sizes
  are unchanged (a restarted scheduler); only the KV budget and verify_symmetry may differ.
- The block count comes from the KV budget: a byte budget (CPU, or a fixed cache on CUDA), or the
  fraction of the device the rank may use in all, measured on the rank's own device after the
  weights are loaded (CUDA). The caller allocates (possibly fewer: the minimum over ranks).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from typing import Callable

import torch

from engine_common.wire.codec import encode_runner_output
from engine_common.wire.diff import RunnerOutput
from engine_common.runtime.gc_heap import freeze_heap
from worker_service.config import NodeLayout, RunnerConfig
from worker_service.device_info import DeviceDescription, describe_device
from worker_service.failures import FailureKind, StepFailure, as_failure
from worker_service.parallel_state import TPGroup
from worker_service.lora.load import runtime_slots
from worker_service.runner.model_runner import ModelRunner
from worker_service.step.owner_scrub import clear_batch_rows, scrub_runner
from worker_service.ranks.rank_api import InitOutcome, ModelSummary, RankStepStats, StepReply

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LaunchedStep:
    """A step launched on the device and not finished yet (RunnerKeeper.launch_step)."""

    pending: object          # the runner's PendingStep
    start: float             # perf_counter at launch, for the step's stats

    def wait_device(self) -> None:
        """Block, without the GIL, until the step's device work is done."""
        self.pending.wait_device()

# Fields that may change without a reload: the KV budget and symmetry verification.
_RELOAD_FREE = {"kv_cache_bytes": None, "gpu_memory_utilization": None, "num_kv_blocks": None,
                "verify_symmetry": False}


class RunnerKeeper:
    """Holds one rank's ModelRunner on `device` inside tensor-parallel group `tp`."""

    def __init__(self, device: str, tp: TPGroup | None = None):
        self.device = device
        self.tp = tp
        self.runner: ModelRunner | None = None
        self.num_kv_blocks = 0
        self.num_model_loads = 0

    # -- building blocks (a rank process calls these one by one) ---------------------------------

    def prepare(self, config: RunnerConfig) -> InitOutcome:
        """Load (or keep) the model and measure how many KV blocks this rank can hold."""
        reloaded = not self._can_keep(config)
        if reloaded:
            self._load(config)
        elif self.runner.lora is not None:
            self.runner.lora.restart(len(config.lora))   # not the last scheduler's adapters
        self.runner.config = config  # same load key; records the KV budget now in force
        return InitOutcome(self._num_blocks(), self.runner.kv_block_bytes, reloaded,
                           self.runner.sliding_window)

    def allocate(self, num_blocks: int) -> None:
        """Drop cached requests; (re)allocate the KV cache when its size changes, else zero the
        one kept (a new epoch may be another scheduler's: step/owner_scrub.py)."""
        self.runner.reset()
        if num_blocks != self.num_kv_blocks or not self.runner.kv_caches:
            self._free_kv_cache()
            self.runner.init_kv_cache(num_blocks)     # zeroed when made
            self.num_kv_blocks = num_blocks
            clear_batch_rows(self.runner.batch)
        else:
            scrub_runner(self.runner)
        freeze_heap()     # start-up is over: collections walk only what steps make

    def run_step(self, payload: bytes, verify: bool, output_rank: bool,
                 inspect: Callable[[RunnerOutput], None] | None = None) -> StepReply:
        """Run one encoded diff: the one step function of an in-process rank and of a rank
        process alike. Every failure becomes a StepFailure of the right kind. `inspect` sees the
        output before it is digested (the test-only corruption of a rank process)."""
        if self.runner is None or not self.ready:
            raise StepFailure(FailureKind.NOT_INITIALIZED, "the rank has no model or KV cache")
        start = time.perf_counter()
        try:
            out = self.runner.execute(payload)
            if inspect is not None:
                inspect(out)
            stats = RankStepStats(self.tp.rank if self.tp else 0, time.perf_counter() - start,
                                  dict(self.runner.clock.phases), len(self.runner.requests))
            digest = self.runner.state_digest(out) if verify else None
            return StepReply(encode_runner_output(out) if output_rank else b"", digest, (stats,))
        except Exception as e:
            failure = as_failure(e)
            if failure.kind == FailureKind.INTERNAL:   # a model, device or collective failure
                log.exception("step failed")
            raise failure from e

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """LoadLora on this rank (docs/lora.md): a refused directory is INVALID_SETTINGS naming
        the path, and the rank's adapters stay as they were."""
        self._lora_call("LoadLora", lambda slots: slots.load(lora_id, name, path))

    def unload_lora(self, lora_id: int) -> None:
        """UnloadLora on this rank: free adapter id `lora_id` (nothing when it is empty)."""
        self._lora_call("UnloadLora", lambda slots: slots.unload(lora_id))

    def _lora_call(self, call: str, change: Callable) -> None:
        if self.runner is None or not self.ready:
            raise StepFailure(FailureKind.NOT_INITIALIZED, "the rank has no model or KV cache")
        try:
            change(runtime_slots(self.runner.lora, self.runner.config, call))
        except Exception as e:
            failure = as_failure(e, at_init=True)      # a LoRAError: the directory's fault
            if failure.kind == FailureKind.INTERNAL:
                log.exception("%s failed", call)
            raise failure from e

    # -- pipelined steps (tp_size 1 on an asynchronous device: service/step_pipeline.py) --------

    @property
    def pipelined(self) -> bool:
        """Whether steps can be launched before the previous one is finished."""
        return self.runner is not None and self.runner.pipelined and self.tp is None

    def launch_step(self, payload: bytes, held: "LaunchedStep | None",
                    finish_first: Callable[[], None]) -> "LaunchedStep":
        """Launch one encoded diff while `held` (the previous step, launched and not finished)
        may still run on the device: its sampled ids reach this step there. A diff that needs
        them on the host calls `finish_first()` (which finishes `held`) before launching.
        Failures become StepFailures, as in run_step."""
        if self.runner is None or not self.ready:
            raise StepFailure(FailureKind.NOT_INITIALIZED, "the rank has no model or KV cache")
        start = time.perf_counter()
        try:
            diff = self.runner.decode(payload)
            if held is not None and self.runner.needs_host_tokens(diff):
                finish_first()
                held = None
            pending = self.runner.launch_step(diff, held and held.pending)
        except Exception as e:
            raise self._step_failure(e) from e
        return LaunchedStep(pending, start)

    def finish_step(self, launched: "LaunchedStep", verify: bool) -> StepReply:
        """The launched step's read-back and reply (as run_step's, for the output rank)."""
        try:
            out = self.runner.finish_step(launched.pending)
            stats = RankStepStats(0, time.perf_counter() - launched.start,
                                  dict(self.runner.clock.phases), len(self.runner.requests))
            digest = self.runner.state_digest(out) if verify else None
            return StepReply(encode_runner_output(out), digest, (stats,))
        except Exception as e:
            raise self._step_failure(e) from e

    @staticmethod
    def _step_failure(e: Exception) -> StepFailure:
        failure = as_failure(e)
        if failure.kind == FailureKind.INTERNAL:
            log.exception("step failed")
        return failure

    @property
    def ready(self) -> bool:
        return self.runner is not None and self.num_kv_blocks > 0

    # -- Ranks: the in-process form (tp_size 1) --------------------------------------------------

    def load(self, config: RunnerConfig, layout: NodeLayout) -> InitOutcome:
        if layout.tp_size != 1:
            raise ValueError(f"layout.tp_size={layout.tp_size} is invalid for one in-process "
                             "rank: must be 1")
        outcome = self.prepare(config)
        self.allocate(outcome.num_kv_blocks)
        return self.allocated(outcome)

    def allocated(self, outcome: InitOutcome) -> InitOutcome:
        """`outcome` with the cache as allocated: its element type, a hybrid model's
        full-group blocks and window group (engine_common/request/kv_groups.py)."""
        outcome = dataclasses.replace(outcome, kv_cache_dtype=self.runner.cache_dtype_name)
        group = self.runner.window_group
        if group is None:
            return outcome
        return dataclasses.replace(outcome, num_kv_blocks=self.runner.diff_bounds.num_kv_blocks,
                                   window_group=group)

    def drop_requests(self) -> int:
        if self.runner is None:
            return 0
        dropped = len(self.runner.requests)
        self.runner.reset()
        scrub_runner(self.runner)      # Reset starts an epoch too (step/owner_scrub.py)
        return dropped

    def interrupt(self) -> None:
        """Nothing waits outside the step itself in one process."""

    def close(self) -> None:
        """Nothing to release beyond the runner, which goes with the process."""

    def set_failure_listener(self, listener: Callable[[str], None]) -> None:
        """An in-process rank cannot die on its own."""

    def readiness(self) -> tuple[bool, str]:
        if self.runner is None:
            return False, "not initialized"
        if self.num_kv_blocks == 0:
            return False, "KV cache not allocated"
        return True, ""

    def describe_devices(self) -> list[DeviceDescription]:
        return [describe_device(self.device)]

    def model_summary(self) -> ModelSummary | None:
        r = self.runner
        if r is None:
            return None
        return ModelSummary(r.config.model_dir, r.attention_backend_name,
                            str(r.model_dtype).removeprefix("torch."))

    def pids(self) -> list[int]:
        return [os.getpid()]

    @property
    def group_id(self) -> str:
        return ""

    # -- helpers --------------------------------------------------------------------------------

    def _can_keep(self, config: RunnerConfig) -> bool:
        if self.runner is None or not self.runner.kv_caches:
            return False
        return (dataclasses.replace(self.runner.config, **_RELOAD_FREE)
                == dataclasses.replace(config, **_RELOAD_FREE))

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
        gc.unfreeze()     # the old model was frozen with the heap (allocate): let it go
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _num_blocks(self) -> int:
        profiled = self.runner.config.gpu_memory_utilization is not None
        if profiled and self.device.startswith("cuda"):
            self._free_kv_cache()  # the current cache does not count as used when profiling
        return self.runner.determine_num_blocks()

    def _free_kv_cache(self) -> None:
        self.runner.free_kv_cache()
        self.num_kv_blocks = 0
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
