"""One node's worker state, without protobuf: the model runner, the epoch and the step sequence.

This is the single-rank, in-process worker. The tensor-parallel worker (rank processes fed over a
shared-memory ring) will offer the same methods, so the servicer does not change.

Rules it enforces:
- `init` keeps a loaded model when the model, dtype, backend, device, lengths and batch sizes are
  unchanged (a restarted scheduler); it then only drops cached requests and, if the KV budget
  changed, re-sizes the cache.
- Steps of an epoch run in order 0, 1, 2, ... A step that fails (gap, bad payload, runner error)
  poisons the epoch: every later step of it fails the same way until `reset` or `init`.
- One Step stream is active at a time. Opening a stream supersedes the previous one: its next
  step fails with SUPERSEDED. (A restarted scheduler must not wait for a half-dead old stream.)
- The runner is used by one thread at a time (a lock); readiness and info never wait for it.
"""
from __future__ import annotations

import dataclasses
import enum
import gc
import hashlib
import logging
import threading
from dataclasses import dataclass

from engine_common.codec import CodecError, encode_runner_output
from worker_service.config import RunnerConfig
from worker_service.device_info import DeviceDescription, describe_device
from worker_service.model_runner import ModelRunner
from worker_service.step_inputs import StepProtocolError

log = logging.getLogger(__name__)

# Memory kept free for activations on CUDA until the profiling run lands (bytes).
_CUDA_ACTIVATION_MARGIN = 1 << 30


def payload_digest(payload: bytes) -> bytes:
    """The optional StepRequest digest: BLAKE2b, 16 bytes, of the payload."""
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass(frozen=True)
class NodeLayout:
    """This node's place in the tensor-parallel group (see ParallelLayout in worker.proto)."""

    tp_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    num_local_ranks: int = 1
    rendezvous_address: str = ""


@dataclass(frozen=True)
class InitOutcome:
    num_kv_blocks: int
    kv_block_bytes: int
    model_reloaded: bool


class FailureKind(enum.Enum):
    """Why a step was refused or failed."""

    NOT_INITIALIZED = "not initialized"
    EPOCH_MISMATCH = "epoch mismatch"
    STEP_GAP = "step gap"
    SUPERSEDED = "superseded"
    BAD_PAYLOAD = "bad payload"     # undecodable bytes or a wrong digest
    BAD_STATE = "bad state"         # decodes, but does not fit the cached requests
    EPOCH_FAILED = "epoch failed"   # an earlier step of this epoch failed
    INTERNAL = "internal"


class StepFailure(RuntimeError):
    def __init__(self, kind: FailureKind, message: str):
        super().__init__(message)
        self.kind = kind


class LocalWorker:
    """A worker service's state for one in-process rank on `device`."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.runner: ModelRunner | None = None
        self.layout = NodeLayout()
        self.epoch: int | None = None
        self.num_kv_blocks = 0
        self.num_model_loads = 0
        self._lock = threading.Lock()
        self._next_step = 0
        self._failure: StepFailure | None = None
        self._active_stream = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def init(self, config: RunnerConfig, layout: NodeLayout, epoch: int,
             gpu_memory_utilization: float | None = None) -> InitOutcome:
        """Load (or keep) the model, size the KV cache, and start `epoch`."""
        if layout.tp_size != 1:
            raise NotImplementedError(f"tp_size={layout.tp_size}: tensor parallelism is not "
                                      "supported by this worker yet (only 1)")
        with self._lock:
            reloaded = not self._can_keep(config)
            if reloaded:
                self._load(config)
            else:
                self.runner.reset()
            num_blocks = self._num_blocks(config, gpu_memory_utilization)
            if reloaded or num_blocks != self.num_kv_blocks or not self.runner.kv_caches:
                self._allocate_kv(num_blocks)
            self.runner.config = config  # same load key; records the KV budget now in force
            self.layout = layout
            self._start_epoch(epoch)
            return InitOutcome(num_blocks, self.runner.kv_block_bytes, reloaded)

    def reset(self, epoch: int) -> int:
        """Start `epoch`; drop every cached request. Returns how many were dropped."""
        with self._lock:
            dropped = 0
            if self.runner is not None:
                dropped = len(self.runner.requests)
                self.runner.reset()
            self._start_epoch(epoch)
            return dropped

    def _can_keep(self, config: RunnerConfig) -> bool:
        if self.runner is None or not self.runner.kv_caches:
            return False
        budget_free = {"kv_cache_bytes": 1, "num_kv_blocks": None}
        return (dataclasses.replace(self.runner.config, **budget_free)
                == dataclasses.replace(config, **budget_free))

    def _load(self, config: RunnerConfig) -> None:
        self._release()
        log.info("loading model %s on %s", config.model_dir, config.device)
        self.runner = ModelRunner(config)
        self.num_model_loads += 1
        log.info("loaded model %s (load #%d, backend %s)", config.model_dir,
                 self.num_model_loads, self.runner.attention_backend_name)

    def _release(self) -> None:
        """Drop the runner and its memory before loading another model."""
        self.runner, self.num_kv_blocks, self.epoch = None, 0, None
        gc.collect()
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.empty_cache()

    def _num_blocks(self, config: RunnerConfig, gpu_memory_utilization: float | None) -> int:
        block_bytes = self.runner.kv_block_bytes
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if gpu_memory_utilization is None or not self.device.startswith("cuda"):
            return max(1, config.kv_cache_bytes // block_bytes)
        # The worker may use `utilization` of the device in all; the cache gets what the weights
        # (and anything else already resident) leave, minus an activation margin.
        self._free_kv_cache()  # the current cache does not count as used
        dev = describe_device(self.device)
        used = dev.total_memory_bytes - dev.free_memory_bytes
        budget = int(gpu_memory_utilization * dev.total_memory_bytes) - used
        budget -= _CUDA_ACTIVATION_MARGIN
        if budget < block_bytes:
            raise MemoryError(f"gpu_memory_utilization={gpu_memory_utilization} leaves "
                              f"{budget} bytes for the KV cache on {dev.name}; one block needs "
                              f"{block_bytes}")
        return budget // block_bytes

    def _allocate_kv(self, num_blocks: int) -> None:
        self._free_kv_cache()
        self.runner.init_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks

    def _free_kv_cache(self) -> None:
        self.runner.kv_caches = []
        self.num_kv_blocks = 0
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.empty_cache()

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._next_step = 0
        self._failure = None

    # -- steps ----------------------------------------------------------------------------------

    def open_stream(self) -> int:
        """Make a new Step stream the active one; returns its id."""
        with self._lock:
            self._active_stream += 1
            return self._active_stream

    def step(self, stream_id: int, epoch: int, step: int, payload: bytes,
             digest: bytes | None = None) -> bytes:
        """Run one step. Returns the encoded RunnerOutput on node 0, b"" (an ack) elsewhere."""
        with self._lock:
            if stream_id != self._active_stream:
                raise StepFailure(FailureKind.SUPERSEDED,
                                  "this Step stream was superseded by a newer one")
            self._check_envelope(epoch, step)
            try:
                out = self._run(payload, digest)
            except StepFailure as failure:
                self._failure = StepFailure(failure.kind, f"epoch {epoch} step {step}: {failure}")
                raise self._failure from failure
            self._next_step += 1
            return encode_runner_output(out) if self.layout.node_rank == 0 else b""

    def _check_envelope(self, epoch: int, step: int) -> None:
        if self.runner is None or self.epoch is None:
            raise StepFailure(FailureKind.NOT_INITIALIZED,
                              "the worker is not initialized: call Init first")
        if epoch != self.epoch:
            raise StepFailure(FailureKind.EPOCH_MISMATCH,
                              f"step {step} carries epoch {epoch}; the current epoch is "
                              f"{self.epoch}")
        if self._failure is not None:
            raise StepFailure(FailureKind.EPOCH_FAILED,
                              f"an earlier step failed ({self._failure.kind.value}: "
                              f"{self._failure}); Reset or Init is required")
        if step != self._next_step:
            self._failure = StepFailure(FailureKind.STEP_GAP,
                                        f"epoch {epoch}: expected step {self._next_step}, "
                                        f"got step {step}")
            raise self._failure

    def _run(self, payload: bytes, digest: bytes | None):
        if digest is not None and digest != payload_digest(payload):
            raise StepFailure(FailureKind.BAD_PAYLOAD, "the payload does not match its digest")
        try:
            return self.runner.execute(payload)
        except CodecError as e:
            raise StepFailure(FailureKind.BAD_PAYLOAD, str(e)) from e
        except StepProtocolError as e:
            raise StepFailure(FailureKind.BAD_STATE, str(e)) from e
        except Exception as e:  # a model or device failure: report it, keep serving
            log.exception("step failed")
            raise StepFailure(FailureKind.INTERNAL, f"{type(e).__name__}: {e}") from e

    # -- introspection (no lock: never waits behind a step or a model load) ----------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): ready once a model is loaded and its KV cache allocated."""
        if self.runner is None:
            return False, "not initialized"
        if self.num_kv_blocks == 0:
            return False, "KV cache not allocated"
        return True, ""

    def describe_devices(self) -> list[DeviceDescription]:
        """This node's devices (one per local rank), measured now."""
        return [describe_device(self.device)]
