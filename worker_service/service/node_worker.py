"""What every flavour of node worker shares: the layout, step failures, and the epoch bookkeeping.

A node worker is the protobuf-free state behind one worker service. Two flavours exist:
`InProcessWorker` (one rank, in this process; tp_size 1) and `RankGroupWorker` (rank processes fed
over a shared-memory ring; tp_size > 1). Both inherit the rules enforced here:

- Steps of an epoch run in order 0, 1, 2, ... A step that fails (gap, bad payload, runner error)
  poisons the epoch: every later step of it fails the same way until `reset` or `init`.
- One Step stream is active at a time. Opening a stream supersedes the previous one: its next
  step fails with SUPERSEDED. (A restarted scheduler must not wait for a half-dead old stream.)
- Steps, Init and Reset hold one lock; `readiness`, `describe_devices` and `model_summary` never
  wait for it. Init first interrupts a step that is still waiting for its ranks.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Callable

from worker_service.config import RunnerConfig
from worker_service.failures import FailureKind, StepFailure
from worker_service.runner.runner_keeper import ModelSummary
from worker_service.device_info import DeviceDescription


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
    group_id: str = ""

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.num_local_ranks + local_rank


@dataclass(frozen=True)
class InitOutcome:
    num_kv_blocks: int      # the minimum over this node's ranks
    kv_block_bytes: int     # per rank
    model_reloaded: bool


@dataclass(frozen=True)
class StepReply:
    """One step's answer: the encoded RunnerOutput on node 0 (b"" elsewhere) and, with symmetry
    verification, the digest every rank of the node agreed on."""

    payload: bytes
    digest: bytes | None = None


def check_layout(started: NodeLayout, requested: NodeLayout) -> None:
    """Init's layout must match the flags the worker was started with (ValueError naming both)."""
    for name, flag in (("node_rank", "--node-rank"), ("num_nodes", "--nodes"),
                       ("num_local_ranks", "--local-ranks")):
        want, got = getattr(started, name), getattr(requested, name)
        if want != got:
            raise ValueError(f"layout.{name}={got} is invalid: this worker was started with "
                             f"{flag} {want} (check the order and number of the scheduler's "
                             "--workers)")


class NodeWorker:
    """The epoch, step and stream bookkeeping; subclasses load, reset and execute.

    Subclasses implement `_load`, `_drop_requests`, `_execute`, `readiness`, `describe_devices`
    and `model_summary`, and may override `_interrupt` and `close`.
    """

    def __init__(self, device: str, layout: NodeLayout):
        self.device = device
        self.started_layout = layout
        self.layout = layout
        self.epoch: int | None = None
        self.num_kv_blocks = 0
        self.verify_symmetry = False
        self._lock = threading.Lock()
        self._next_step = 0
        self._failure: StepFailure | None = None
        self._active_stream = 0
        self._readiness_listener: Callable[[bool], None] = lambda ready: None

    def set_readiness_listener(self, listener: Callable[[bool], None]) -> None:
        """`listener(False)` is called when the worker stops being ready on its own (a rank
        died); Init and Reset report readiness through their callers."""
        self._readiness_listener = listener

    # -- lifecycle ------------------------------------------------------------------------------

    def init(self, config: RunnerConfig, layout: NodeLayout, epoch: int,
             gpu_memory_utilization: float | None = None,
             verify_symmetry: bool = False) -> InitOutcome:
        """Load (or keep) the model, size the KV cache, join the group, and start `epoch`."""
        check_layout(self.started_layout, layout)
        self._interrupt()
        with self._lock:
            self.epoch = None
            outcome = self._load(config, layout, gpu_memory_utilization)
            self.num_kv_blocks = outcome.num_kv_blocks
            self.layout = layout
            self.verify_symmetry = verify_symmetry
            self._start_epoch(epoch)
            return outcome

    def reset(self, epoch: int) -> int:
        """Start `epoch`; drop every cached request. Returns how many were dropped."""
        self._interrupt()
        with self._lock:
            dropped = self._drop_requests()
            self._start_epoch(epoch)
            return dropped

    def close(self) -> None:
        """Release processes and shared memory (the service is stopping)."""

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
             digest: bytes | None = None) -> StepReply:
        """Run one step of the active stream."""
        with self._lock:
            if stream_id != self._active_stream:
                raise StepFailure(FailureKind.SUPERSEDED,
                                  "this Step stream was superseded by a newer one")
            self._check_envelope(epoch, step)
            try:
                if digest is not None and digest != payload_digest(payload):
                    raise StepFailure(FailureKind.BAD_PAYLOAD,
                                      "the payload does not match its digest")
                reply = self._execute(payload)
            except StepFailure as failure:
                self._failure = StepFailure(failure.kind, f"epoch {epoch} step {step}: {failure}")
                raise self._failure from failure
            self._next_step += 1
            return reply

    def _check_envelope(self, epoch: int, step: int) -> None:
        if self.epoch is None:
            raise StepFailure(FailureKind.NOT_INITIALIZED,
                              "the worker is not initialized: call Init first")
        ready, reason = self.readiness()
        if not ready:  # initialized, then lost a rank
            raise StepFailure(FailureKind.RANK_FAILED, f"the worker is not ready: {reason}")
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

    # -- subclass hooks -------------------------------------------------------------------------

    def _interrupt(self) -> None:
        """Make a step that is waiting (for rank replies) give up; called before Init/Reset."""

    def _load(self, config: RunnerConfig, layout: NodeLayout,
              gpu_memory_utilization: float | None) -> InitOutcome:
        raise NotImplementedError

    def _drop_requests(self) -> int:
        raise NotImplementedError

    def _execute(self, payload: bytes) -> StepReply:
        raise NotImplementedError

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): ready once the model is loaded and its KV cache allocated."""
        raise NotImplementedError

    def describe_devices(self) -> list[DeviceDescription]:
        """This node's devices (one per local rank)."""
        raise NotImplementedError

    def model_summary(self) -> ModelSummary | None:
        """The loaded model, or None before Init."""
        raise NotImplementedError

    @property
    def group_id(self) -> str:
        """The process group the ranks are in now ("" when none)."""
        return ""
