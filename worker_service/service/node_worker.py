"""The node worker: the epoch, step and stream rules of one worker service, over its Ranks.

A node worker is the protobuf-free state behind one worker service. It drives the node's ranks
through the Ranks interface (ranks/rank_api.py): one in-process RunnerKeeper (tp_size 1) or a
RankGroup of rank processes (tp_size > 1). The rules enforced here:

- One scheduler at a time (fencing.py): Init must carry an epoch above every epoch accepted
  before; a higher one from another scheduler takes the worker over, and the displaced
  scheduler's steps fail STALE_EPOCH. Reset is the owner's only, with the epoch's stream key.
- An Init interrupts one in progress only with a higher epoch (an equal or lower one is refused
  SUPERSEDED: two schedulers must not abort each other's loads in turn forever).
- A refused Init changes nothing (init_checks.py runs before the model is touched): the loaded
  model, the epoch and the owner stay.
- Steps of an epoch run in order 0, 1, 2, ... A step that fails (gap, bad payload, runner error)
  poisons the epoch: every later step of it fails the same way until `reset` or `init`.
- One Step stream is active at a time. A newer stream supersedes the active one when its first
  step carries the current epoch (the owner's: an outsider's stream cannot); the older stream's
  next step then fails with SUPERSEDED. (A restarted scheduler must not wait for a half-dead old
  stream.)
- A Step stream must present the current epoch's stream key when it opens (stream_keys.py):
  every Init and Reset makes a new one, told only to its caller; a stream of another holder of
  the token is refused before it can supersede the owner's or learn a step number.
- When the stream that runs the epoch ends and no stream of the epoch steps within a grace, the
  cached requests are dropped and the epoch ends (orphan_watch.py: a scheduler that died).
- Steps, Init and Reset hold one lock; `readiness`, `describe_devices` and `model_summary` never
  wait for it. Init first interrupts a step that is still waiting for its ranks.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from engine_common.model_files.model_dir import read_model_configs
from worker_service.config import NodeLayout, RunnerConfig
from worker_service.models.tp_sizes import check_tp_size
from worker_service.device_info import DeviceDescription
from worker_service.failures import FailureKind, StepFailure, as_failure
from worker_service.ranks.rank_api import InitOutcome, ModelSummary, Ranks, StepReply
from worker_service.service.fencing import Fence, check_owner
from worker_service.service.init_checks import InitGuards, check_init, check_layout
from worker_service.service.orphan_watch import ORPHAN_GRACE_S, Key, OrphanWatch
from worker_service.service.step_digest import check_digest
from worker_service.service.stream_keys import StreamKeys

log = logging.getLogger(__name__)


class NodeWorker:
    """The epoch, step and stream bookkeeping of one worker service over `ranks`."""

    def __init__(self, ranks: Ranks, layout: NodeLayout, guards: InitGuards = InitGuards(),
                 orphan_grace_s: float = ORPHAN_GRACE_S):
        self.ranks = ranks
        self.device = ranks.device
        self.started_layout = layout
        self.layout = layout
        self.guards = guards
        self.fence = Fence()
        self.epoch: int | None = None      # the epoch steps run in; None while not runnable
        self.num_kv_blocks = 0
        self.verify_symmetry = False
        self._lock = threading.Lock()
        self._claims = threading.Lock()    # guards _claimed; never held across a load
        self._claimed: tuple[int, str] = (0, "")   # the (epoch, owner) of an Init in progress
        self._next_step = 0
        self._failure: StepFailure | None = None
        self.streams = StreamKeys()        # the epoch's stream key, the streams' ids
        self._active_stream = 0
        self._held = None      # (stream id, step, LaunchedStep): launched, not finished
        self.orphans = OrphanWatch(orphan_grace_s)     # tests replace its call_later
        # Called with every successful step's reply (the worker's metrics).
        self.step_listener: Callable[[StepReply], None] | None = None

    def set_readiness_listener(self, listener: Callable[[bool], None]) -> None:
        """`listener(False)` is called when the worker stops being ready on its own (a rank
        died); Init and Reset report readiness through their callers."""
        self.ranks.set_failure_listener(lambda reason: listener(False))

    # -- lifecycle ------------------------------------------------------------------------------

    def init(self, config: RunnerConfig, layout: NodeLayout, epoch: int,
             owner: str = "") -> InitOutcome:
        """Load (or keep) the model, size the KV cache, join the group, and start `epoch` for
        scheduler `owner`. Refused (StepFailure STALE_EPOCH, ValueError, NotImplementedError,
        DoesNotFit) before anything changes; the epoch and owner change only once the load
        succeeded (a failed load leaves the worker without a model, its fence as it was)."""
        check_layout(self.started_layout, layout)
        check_owner(owner)
        self.fence.check(epoch)
        check_init(config, self.guards, layout)
        if layout.tp_size > 1:    # refused here, once, before any rank loads anything
            check_tp_size(read_model_configs(Path(config.model_dir))[0], layout.tp_size)
        self._claim(epoch, owner)
        try:
            return self._init_claimed(config, layout, epoch, owner)
        finally:
            with self._claims:
                if self._claimed[0] == epoch:
                    self._claimed = (0, "")

    def _claim(self, epoch: int, owner: str) -> None:
        """Only an Init above the one in progress may interrupt it. An epoch counts in the fence
        only once its load is done, so a displaced scheduler that re-Inits at once (its step was
        interrupted) asks for the same epoch as the newer one that is loading: it used to
        interrupt that load, the newer one retried and interrupted its load in turn, and with
        loads longer than their retry pause neither ever finished.

        The fence is checked again here, and the ranks interrupted, under the claim: an Init
        that passed the fence while another's load ran, and ran its checks while that load
        finished, found itself stale only under the lock, after interrupting; a rank group's
        interrupt stays set until the next load, so the new owner's next step was aborted and
        its ranks respawned by a refused Init."""
        with self._claims:
            self._check_claim(epoch)
            self.fence.check(epoch)      # an Init that completed meanwhile took a higher one
            self._claimed = (epoch, owner)
            self.ranks.interrupt()

    def _check_claim(self, epoch: int, any_init: bool = False) -> None:
        """SUPERSEDED when an Init of `epoch` or above (`any_init`: any Init) is in progress
        (under _claims)."""
        claimed, by = self._claimed
        if epoch <= claimed or (any_init and claimed):
            raise StepFailure(FailureKind.SUPERSEDED,
                              f"epoch {epoch} not taken: an Init of epoch {claimed} "
                              f"(scheduler {by or '?'}) is in progress; retry once it is "
                              "done (see Info)")

    def _init_claimed(self, config: RunnerConfig, layout: NodeLayout, epoch: int,
                      owner: str) -> InitOutcome:
        with self._lock:
            self.fence.check(epoch)       # another Init may have taken it while this waited
            self.epoch = None
            self._drop_held()
            outcome = self.ranks.load(config, layout)
            previous = self.fence.take(epoch, owner)
            if previous is not None:
                log.warning("scheduler %s took this worker over from scheduler %s (epoch %d)",
                            owner or "?", previous, epoch)
            self.num_kv_blocks = outcome.num_kv_blocks
            self.layout = layout
            self.verify_symmetry = config.verify_symmetry
            self._start_epoch(epoch)
            return outcome

    def reset(self, epoch: int, owner: str, key: bytes | None) -> int:
        """Start `epoch` (the owner's only, a higher one, presenting the current epoch's stream
        `key`); drop every cached request. Returns how many were dropped."""
        self._check_reset(epoch, owner, key)
        with self._claims:   # a takeover's load in progress is not the owner's to interrupt
            self._check_claim(epoch, any_init=True)
            self._check_reset(epoch, owner, key)
            self.ranks.interrupt()
        with self._lock:
            self._check_reset(epoch, owner, key)
            self._drop_held()
            try:
                dropped = self.ranks.drop_requests()
            except Exception as e:  # noqa: BLE001 - any error (a CUDA one too) may leave half
                # the requests dropped. The fence stays (the owner's steps must not read as a
                # takeover's, STALE); the current epoch is over.
                failure = as_failure(e)
                self._failure = failure.within(f"a Reset to epoch {epoch} failed")
                raise
            self.fence.take(epoch, owner)
            self._start_epoch(epoch)
            return dropped

    def _check_reset(self, epoch: int, owner: str, key: bytes | None) -> None:
        """The fence first (a displaced owner learns STALE_EPOCH, as from a step), then the key:
        the owner's id is public (Info), the key only its Init's or Reset's caller knows."""
        self.fence.check_reset(epoch, owner)
        self.streams.check_reset(key)

    def owner_call(self, epoch: int, owner: str, key: bytes | None, call: str,
                   fn: Callable[[Ranks], object]):
        """fn(ranks) between steps, for the owner of the current epoch presenting its stream
        key (LoadLora, UnloadLora: docs/lora.md); a failure does not end the epoch."""
        self._check_owner_call(epoch, owner, key, call)
        with self._lock:
            self._check_owner_call(epoch, owner, key, call)
            return fn(self.ranks)

    def _check_owner_call(self, epoch: int, owner: str, key: bytes | None, call: str) -> None:
        check_owner(owner)
        if not self.fence.epoch or owner != self.fence.owner:
            raise StepFailure(FailureKind.STALE_EPOCH, f"{call}: scheduler {owner or '?'} does "
                              f"not own this worker (scheduler {self.fence.owner or '?'} does)")
        if epoch != self.epoch:
            raise StepFailure(FailureKind.EPOCH_MISMATCH, f"{call}: epoch={epoch} is invalid: "
                              f"must be the current epoch {self.epoch}")
        self.streams.check_key(key, call)

    def close(self) -> None:
        """Release processes and shared memory (the service is stopping)."""
        self.ranks.interrupt()
        with self._lock:
            self.ranks.close()

    def _start_epoch(self, epoch: int) -> None:
        self._drop_held()
        self.streams.new_epoch(epoch)
        self.orphans.new_epoch()
        self.epoch = epoch
        self._next_step = 0
        self._failure = None

    # -- steps ----------------------------------------------------------------------------------

    def stream_key(self, epoch: int | None) -> bytes:
        """The stream key of `epoch` while it is current (for the caller that started it)."""
        return self.streams.key(epoch)

    def open_stream(self, key: bytes | None) -> int:
        """A new Step stream's id, when it presents the current epoch's key (else StepFailure
        NOT_ALLOWED); it becomes the active one at its first step of the epoch (`step`)."""
        return self.streams.open(key)

    def stream_ended(self, stream_id: int) -> None:
        """A Step stream's handler is done (the stream ended, failed or was cancelled)."""
        self.orphans.ended(stream_id, self._drop_orphaned)

    def _drop_orphaned(self, key: Key) -> None:
        """The grace after the epoch's stream ended is over and no stream stepped since: drop
        every cached request (and zero the KV cache) on every rank, and end the epoch."""
        with self._lock:
            if not self.orphans.due(key) or self.epoch != key[0]:
                return
            self._drop_held()
            try:
                dropped = f"its {self.ranks.drop_requests()} cached requests were dropped"
            except Exception as e:  # noqa: BLE001 - the epoch ends whatever the drop raised
                dropped = f"dropping its cached requests failed ({as_failure(e)})"
            why = (f"the Step stream of epoch {key[0]} ended and no stream of the epoch stepped "
                   f"within {self.orphans.grace_s:g} s: {dropped}")
            log.warning("%s; Reset or Init is required", why)
            if self._failure is None:       # a failed epoch keeps the failure it had
                self._failure = StepFailure(FailureKind.EPOCH_FAILED, why)

    def step(self, stream_id: int, epoch: int, step: int, payload: bytes,
             digest: bytes | None = None) -> StepReply:
        """Run one step of the active stream (a newer stream with the current epoch takes over
        as the active one)."""
        with self._lock:
            self._admit(stream_id, epoch, step)
            try:
                check_digest(payload, digest)
                reply = self.ranks.run_step(payload, self.verify_symmetry,
                                            self.layout.node_rank == 0)
            except StepFailure as failure:
                raise self._fail_epoch(failure, epoch, step) from failure
            self._next_step += 1
            if self.step_listener is not None:
                self.step_listener(reply)
            return reply

    def _admit(self, stream_id: int, epoch: int, step: int) -> None:
        """The stream and envelope rules of a step; `stream_id` becomes the active stream."""
        if stream_id < self._active_stream:
            raise StepFailure(FailureKind.SUPERSEDED,
                              "this Step stream was superseded by a newer one")
        self.streams.check_step(stream_id, epoch)
        # A stream that is not the active one yet fails the epoch only once it is.
        self._check_envelope(epoch, step, fail_epoch=stream_id == self._active_stream)
        if self._held is not None and self._held[0] != stream_id:
            self._drop_held()                  # a newer stream of the same epoch took over
        self._active_stream = stream_id
        self.orphans.stepped(epoch, stream_id)

    def _fail_epoch(self, failure: StepFailure, epoch: int, step: int) -> StepFailure:
        """Record the failure that poisons the epoch; the caller raises it."""
        self._failure = failure.within(f"epoch {epoch} step {step}")
        return self._failure

    # -- pipelined steps (service/step_pipeline.py) ----------------------------------------------
    # With one in-process rank on an asynchronous device (CUDA, the simulated one) a step is
    # launched before the previous one is finished, so the device never waits for the host's
    # work between them: `launch_step` launches step t and finishes the held step t-1,
    # returning its reply; `flush` finishes the held step when no next step has come. Any
    # failure drops the held step (its device work is waited for) and fails the epoch.

    @property
    def pipelined(self) -> bool:
        return bool(getattr(self.ranks, "pipelined", False))

    def launch_step(self, stream_id: int, epoch: int, step: int, payload: bytes,
                    digest: bytes | None = None) -> list[tuple[int, StepReply]]:
        """Launch one step; return the (step, reply) pairs now ready, in step order."""
        with self._lock:
            self._admit(stream_id, epoch, step)
            replies: list[tuple[int, StepReply]] = []
            try:
                check_digest(payload, digest)
                held = self._held[2] if self._held is not None else None
                launched = self.ranks.launch_step(payload, held,
                                                  lambda: replies.append(self._finish_held()))
                if self._held is not None:
                    replies.append(self._finish_held())
            except StepFailure as failure:
                self._drop_held()
                raise self._fail_epoch(failure, epoch, step) from failure
            self._held = (stream_id, step, launched)
            self._next_step += 1
            return replies

    def flush(self, stream_id: int) -> list[tuple[int, StepReply]]:
        """Finish the step `stream_id` holds, if any: its (step, reply), or nothing."""
        with self._lock:
            if self._held is None or self._held[0] != stream_id:
                return []
            try:
                return [self._finish_held()]
            except StepFailure as failure:
                self._failure = failure.within(f"epoch {self.epoch}")
                raise self._failure from failure

    def held_step(self, stream_id: int):
        """The launched, unfinished step of `stream_id` (for waiting on its device work)."""
        held = self._held
        return held[2] if held is not None and held[0] == stream_id else None

    def _finish_held(self) -> tuple[int, StepReply]:
        _, step, launched = self._held
        self._held = None
        reply = self.ranks.finish_step(launched, self.verify_symmetry)
        if self.step_listener is not None:
            self.step_listener(reply)
        return step, reply

    def _drop_held(self) -> None:
        """Forget the held step once its device work is done (its buffers are then free)."""
        if self._held is not None:
            launched, self._held = self._held[2], None
            launched.wait_device()

    def _check_envelope(self, epoch: int, step: int, fail_epoch: bool) -> None:
        if epoch < self.fence.epoch:
            raise self.fence.stale(epoch, step)
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
                              f"epoch {epoch} failed earlier ({self._failure.retold()}); "
                              "Reset or Init is required")
        if step != self._next_step:
            gap = StepFailure(FailureKind.STEP_GAP,
                              f"epoch {epoch}: expected step {self._next_step}, got step {step}")
            if fail_epoch:
                self._failure = gap
            raise gap

    # -- introspection (no lock: never waits behind a step or a model load) ----------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): ready once the model is loaded and its KV cache allocated."""
        return self.ranks.readiness()

    def describe_devices(self) -> list[DeviceDescription]:
        return self.ranks.describe_devices()

    def model_summary(self) -> ModelSummary | None:
        return self.ranks.model_summary()

    @property
    def group_id(self) -> str:
        return self.ranks.group_id
