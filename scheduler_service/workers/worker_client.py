"""The scheduler's side of the Worker protocol: Init every worker, then stream each step to all.

Torch-free. One WorkerClient talks to every worker service (node) of one model replica; the worker
at `addresses[0]` is node 0, which holds the output rank and answers with the RunnerOutput; the
others answer with empty acknowledgements.

    init(spec)  -> Info from every worker (how it was started, its epoch and owner); plan the
                   group (group_plan.py); an epoch above every worker's and this client's last;
                   Init on all workers at once (tensor-parallel ranks rendezvous inside Init, so
                   the calls must overlap; the first failure cancels the rest); then one Step
                   stream per worker, each presenting the key that worker's Init returned
    execute(p)  -> StepRequest(epoch, step, p) to every worker (once per node, never per rank;
                   the bytes do not depend on the TP size), step = 0, 1, 2, ... per epoch;
                   wait for every reply; return node 0's payload. With verify_symmetry every
                   node's digest must be equal, else SymmetryError (and the next init re-forms
                   the process group)

Any failure (unreachable worker, broken stream, StepError, no reply in time) raises
WorkerFailure naming the worker, and fails the client until the next `init` or `reset`. A step
is late after `step_timeout_s` plus twice the slowest of the recent steps; then the worker must
answer a Health call within the smaller of `connect_timeout_s` and `step_timeout_s` (a frozen or
unreachable worker fails the step at once), and a worker that answers gets another `step_timeout_s`, up to MAX_SLOW_PERIODS in all
(a slow step on a busy machine is not a dead worker).

Fencing. Every call carries this client's credential (channels.py) and every Init its
`scheduler_id`. A worker accepts only epochs above the highest it has seen, so a client that
starts takes the workers over by going above the epoch their Info reports. A client that has
driven the workers and then finds one owned by another scheduler at a higher epoch (STALE_EPOCH
on a step, a refused Init or Reset, or Info at its next init) raises Fenced: the newer scheduler
won, and this one must stop rather than take the workers back.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import time
from typing import Callable

import grpc

from engine_common.request.params import ParamError
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from engine_common.security.stream_key import stream_key_metadata
from engine_common.security.worker_auth import WorkerAuth
from scheduler_service.errors import Fenced, WorkerFailure, WorkerRefused
from scheduler_service.workers.channels import worker_channel
from scheduler_service.workers.group_plan import plan_group
from scheduler_service.workers.init_messages import (allocated_kv_cache_dtype, init_request,
                                                     shared_kv_block_bytes,
                                                     shared_window, shared_window_group,
                                                     worker_device)
from scheduler_service.workers.worker_spec import (DEFAULT_DIST_PORT, InitResult, InitSpec,
                                                   WorkerDevice, WorkerHealth)
from scheduler_service.workers.worker_stream import (PeerEnded, StepLate, StepStream,
                                                     SymmetryError, describe_rpc_error)

__all__ = ["DEFAULT_DIST_PORT", "InitResult", "InitSpec", "SymmetryError", "WorkerClient",
           "WorkerDevice", "WorkerHealth"]

log = logging.getLogger(__name__)

# The step deadline's allowance for slow steps decays by this factor per step (about a hundred
# steps to forget a slow one).
_SLOWEST_DECAY = 0.97
# A late step whose worker still answers Health gets another step timeout, this many in all.
MAX_SLOW_PERIODS = 30


def new_scheduler_id() -> str:
    """Names one scheduler process in the workers' Info and logs: host:pid:random."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class WorkerClient:
    """Client of every worker service of one replica; implements the engine's StepExecutor."""

    def __init__(self, addresses: list[str], connect_timeout_s: float = 5.0,
                 step_timeout_s: float = 120.0, init_timeout_s: float = 600.0,
                 auth: WorkerAuth = WorkerAuth(), scheduler_id: str | None = None):
        if not addresses:
            raise ParamError("addresses", addresses, "at least one HOST:PORT")
        self.addresses = list(addresses)
        self.connect_timeout_s = connect_timeout_s
        self.step_timeout_s = step_timeout_s
        self.init_timeout_s = init_timeout_s
        self.scheduler_id = scheduler_id or new_scheduler_id()
        self._channels = [worker_channel(a, auth) for a in addresses]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        self._streams: list[StepStream] = []
        self._stream_keys: list[bytes] = []    # the epoch's, one per worker (secret): its
        #                                        streams and its Reset present them
        self.epoch: int | None = None
        self.owned_epoch = 0          # the last epoch this client started (0: none yet)
        self._init_epoch = 0          # the epoch of the last Init sent
        self.verify_symmetry = False
        self._next_step = 0
        self._failure: str | None = "not initialized: call init() first"
        self._force_new_group = False
        self._slowest_step_s = 0.0
        self._last_reply = 0.0
        self._collected = -1          # the last step collected in this epoch

    # -- lifecycle ------------------------------------------------------------------------------

    def init(self, spec: InitSpec) -> InitResult:
        """Start a new epoch on every worker with `spec`; open the Step streams."""
        self._close_streams()
        self._failure = "an init() did not complete"
        infos = self._wait_ready()
        self.check_owner(infos)
        plan = plan_group(self.addresses, infos,
                          num_local_ranks=spec.num_local_ranks,
                          rendezvous_address=spec.rendezvous_address, dist_port=spec.dist_port,
                          force_new=self._force_new_group)
        epoch = max([self.owned_epoch] + [info.epoch for info in infos]) + 1
        self._init_epoch = epoch
        calls = [stub.Init.future(init_request(spec, epoch, plan.layout_pb(node),
                                               self.scheduler_id),
                                  timeout=self.init_timeout_s)
                 for node, stub in enumerate(self._stubs)]
        replies = self._all_results(calls, "Init")
        cache_dtype = allocated_kv_cache_dtype(      # before the epoch's streams open
            spec.config.kv_cache_dtype,
            [(addr, r.kv_cache_dtype) for addr, r in zip(self.addresses, replies)])
        self.owned_epoch = epoch
        self._force_new_group = False
        self.verify_symmetry = spec.config.verify_symmetry
        self._start_epoch(epoch, [r.stream_key for r in replies])
        devices = tuple(worker_device(d, addr, node) for node, (addr, r) in
                        enumerate(zip(self.addresses, replies)) for d in r.devices)
        return InitResult(epoch=epoch, num_kv_blocks=min(r.num_kv_blocks for r in replies),
                          kv_block_bytes=shared_kv_block_bytes(
                              [r.kv_block_bytes for r in replies]), devices=devices,
                          tp_size=plan.tp_size, group_id=plan.group_id,
                          sliding_window=shared_window([r.sliding_window for r in replies]),
                          window_group=shared_window_group(
                              [(r.window_group_window, r.window_group_blocks) for r in replies]),
                          kv_cache_dtype=cache_dtype,
                          pipelined=all(r.pipelined for r in replies))

    def reset(self) -> int:
        """Start a new epoch on every worker; returns how many cached requests node 0 dropped.
        Each worker's Reset presents that worker's key of the current epoch (the worker refuses
        a Reset without it: the owner's id is public)."""
        self._close_streams()
        self._failure = "a reset() did not complete"
        epoch = self.owned_epoch + 1
        request = worker_pb2.ResetRequest(epoch=epoch, scheduler_id=self.scheduler_id)
        keys = self._stream_keys or [b""] * len(self._stubs)    # none before an Init: refused
        calls = [stub.Reset.future(request, timeout=self.connect_timeout_s,
                                   metadata=stream_key_metadata(key))
                 for stub, key in zip(self._stubs, keys)]
        replies = [self._result(call, addr, "Reset") for call, addr in zip(calls, self.addresses)]
        self.owned_epoch = epoch
        self._start_epoch(epoch, [r.stream_key for r in replies])
        return replies[0].num_dropped_requests

    def call_owned(self, rpc: str, make_request: Callable[[int, str], object]) -> list:
        """`rpc` (LoadLora, UnloadLora) on every worker at once, as the owner of the current
        epoch (make_request(epoch, scheduler_id)), each call with that worker's stream key. One
        entry per worker, in order: its reply, or the grpc.RpcError it failed with."""
        request = make_request(self.owned_epoch, self.scheduler_id)
        keys = self._stream_keys or [b""] * len(self._stubs)
        calls = [getattr(stub, rpc).future(request, timeout=self.init_timeout_s,
                                           metadata=stream_key_metadata(key))
                 for stub, key in zip(self._stubs, keys)]
        out = []
        for call in calls:
            try:
                out.append(call.result())
            except grpc.RpcError as e:
                out.append(e)
        return out

    def close(self) -> None:
        """End the streams and close the channels (and forget the epoch's keys)."""
        self._close_streams()
        self._stream_keys = []
        self._failure = "closed"
        for channel in self._channels:
            channel.close()

    def health(self) -> list[WorkerHealth]:
        """Each worker's readiness; an unreachable worker is not ready, with the reason."""
        calls = [stub.Health.future(worker_pb2.HealthRequest(), timeout=self.connect_timeout_s)
                 for stub in self._stubs]
        out = []
        for call, addr in zip(calls, self.addresses):
            try:
                reply = call.result()
                out.append(WorkerHealth(addr, reply.ready, reply.reason, reply.epoch,
                                        reply.scheduler_id))
            except grpc.RpcError as e:
                out.append(WorkerHealth(addr, False, f"unreachable: {describe_rpc_error(e)}"))
        return out

    # -- steps ----------------------------------------------------------------------------------

    def execute(self, payload: bytes) -> bytes:
        """Run one step on every worker; return node 0's encoded RunnerOutput."""
        step = self.submit(payload)
        return self.collect(step)

    def submit(self, payload: bytes) -> int:
        """Send one step to every worker without waiting; returns its step number."""
        self._check_usable()
        step = self._next_step
        self._next_step += 1
        request = worker_pb2.StepRequest(epoch=self.epoch, step=step, payload=payload)
        if step == self._collected + 1:   # nothing in flight: the step starts now
            self._last_reply = time.monotonic()
        for stream in self._streams:
            stream.send(request)
        return step

    def collect(self, step: int) -> bytes:
        """Wait for every worker's reply to `step` (the oldest one in flight)."""
        self._check_usable()
        deadline = time.monotonic() + self.step_timeout_s + 2 * self._slowest_step_s
        try:
            replies = [self._receive(i, step, deadline) for i in range(len(self._streams))]
            if self.verify_symmetry:
                self._check_symmetry(step, replies)
        except Fenced as e:
            self._fail(str(e))
            if self._owned_by_another():
                raise
            # A new epoch under its own id from elsewhere (an operator's Init naming this
            # scheduler; a Reset needs its key): a failed step, which the next init repairs.
            raise WorkerFailure(f"{e} (this scheduler still owns the worker: a new epoch was "
                                "started under its id from elsewhere)",
                                kind="stale_epoch") from None
        except WorkerFailure as e:
            self._force_new_group |= isinstance(e, SymmetryError)
            self._fail(str(e))
            raise
        self._note_step_time(step)
        return replies[0].payload

    def _receive(self, node: int, step: int, deadline: float):
        """Node `node`'s reply to `step`; past the deadline, only while the worker answers.
        When another node's stream ended first, that node's own failure (its StepError or how
        its stream ended), at once."""
        try:
            return self._receive_late(node, step, deadline)
        except PeerEnded as ended:
            if self._streams.index(ended.peer) > node:    # its reply to `step` is not read yet
                ended.peer.receive(self.epoch, step, time.monotonic())   # raises its failure
            raise                    # it had answered this step: it ended at a later one

    def _receive_late(self, node: int, step: int, deadline: float):
        for _ in range(MAX_SLOW_PERIODS - 1):
            try:
                return self._streams[node].receive(self.epoch, step, deadline)
            except StepLate as late:
                why = self._unresponsive(node)
                if why is not None:
                    raise StepLate(f"{late}; {why}") from None
                log.warning("worker %s: step %d is slow but the worker answers: waiting another "
                            "%gs", self.addresses[node], step, self.step_timeout_s)
                deadline = time.monotonic() + self.step_timeout_s
        return self._streams[node].receive(self.epoch, step, deadline)

    def _unresponsive(self, node: int) -> str | None:
        """None when the worker answers Health in time, else why not."""
        try:
            self._stubs[node].Health(worker_pb2.HealthRequest(),
                                     timeout=min(self.connect_timeout_s, self.step_timeout_s))
            return None
        except grpc.RpcError as e:
            return f"and it does not answer Health ({describe_rpc_error(e)})"

    def _note_step_time(self, step: int) -> None:
        """The step took from its start (its submit, or the previous reply while two are in
        flight) to now; keep a slowly decaying maximum."""
        now = time.monotonic()
        self._slowest_step_s = max(now - self._last_reply,
                                   self._slowest_step_s * _SLOWEST_DECAY)
        self._last_reply = now
        self._collected = step

    def _check_symmetry(self, step: int, replies: list) -> None:
        """Every node's digest must be present and equal (each already agrees within its node)."""
        digests = [r.digest if r.HasField("digest") else None for r in replies]
        for addr, digest in zip(self.addresses, digests):
            if digest is None:
                raise WorkerFailure(f"worker {addr}: step {step} came back without a digest "
                                    "although verify_symmetry is on")
        if len(set(digests)) > 1:
            listed = ", ".join(f"node {n} ({a}) {d.hex()}"
                               for n, (a, d) in enumerate(zip(self.addresses, digests)))
            raise SymmetryError(f"symmetry divergence at epoch {self.epoch} step {step}: the "
                                f"nodes disagree on their sampled ids or cached state ({listed})")

    # -- helpers --------------------------------------------------------------------------------

    def check_owner(self, infos: list) -> None:
        """Fenced when this client drove the workers and one of `infos` (InfoResponses or
        WorkerHealths, in address order) reports another owner at a higher epoch (a newer
        scheduler took over)."""
        if not self.owned_epoch:
            return
        for addr, info in zip(self.addresses, infos):
            if info.scheduler_id not in ("", self.scheduler_id) and info.epoch > self.owned_epoch:
                raise Fenced(f"worker {addr} is driven by scheduler {info.scheduler_id} since "
                             f"epoch {info.epoch} (this scheduler's last epoch: "
                             f"{self.owned_epoch}): a newer scheduler took over; this one stops")

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise WorkerFailure(f"the worker client is unusable: {self._failure}")

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self._close_streams()

    def _wait_ready(self) -> list:
        """Every worker's Info, waiting up to connect_timeout_s for each to answer (a call that
        waits for the connection; channel_ready_future would leave a polling thread behind)."""
        calls = [stub.Info.future(worker_pb2.InfoRequest(), wait_for_ready=True,
                                  timeout=self.connect_timeout_s) for stub in self._stubs]
        infos = []
        for call, addr in zip(calls, self.addresses):
            try:
                infos.append(call.result())
            except grpc.RpcError as e:
                raise WorkerFailure(f"worker {addr}: not reachable within "
                                    f"{self.connect_timeout_s:g}s ({describe_rpc_error(e)})"
                                    ) from None
        return infos

    def _all_results(self, calls: list, rpc: str) -> list:
        """Every call's result, in order. The first failure cancels the others at once (a node
        that waits in a rendezvous for a failed peer must not hold the caller)."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        for i, call in enumerate(calls):
            call.add_done_callback(lambda _, i=i: done.put(i))
        for _ in calls:
            i = done.get()
            try:
                calls[i].result()
            except grpc.RpcError:
                for other in calls:
                    other.cancel()
                self._result(calls[i], self.addresses[i], rpc)
        return [self._result(call, addr, rpc) for call, addr in zip(calls, self.addresses)]

    def _result(self, call, addr: str, rpc: str):
        try:
            return call.result()
        except grpc.RpcError as e:
            raise self._rpc_failure(e, rpc)(
                f"worker {addr}: {rpc} failed: {describe_rpc_error(e)}") from e

    def _rpc_failure(self, e: grpc.RpcError, rpc: str) -> type[WorkerFailure]:
        """A refused Init's settings: WorkerRefused; a stale epoch (FAILED_PRECONDITION on Init
        or Reset) after this client drove the workers: Fenced; else WorkerFailure. An Init's
        FAILED_PRECONDITION is a stale epoch only when a worker reports another owner now; else
        the settings do not fit the machine (a refusal, like INVALID_ARGUMENT)."""
        code = e.code()
        if rpc == "Init" and code == grpc.StatusCode.INVALID_ARGUMENT:
            return WorkerRefused
        if rpc == "Init" and code == grpc.StatusCode.FAILED_PRECONDITION \
                and not self._owned_by_another():
            return WorkerRefused
        if code == grpc.StatusCode.FAILED_PRECONDITION and self.owned_epoch:
            return Fenced
        return WorkerFailure

    def _owned_by_another(self) -> bool:
        """Whether a worker reports another owner at the epoch this client's Init asked for or
        above (the Init was stale, not refused; a STALE_EPOCH step was a takeover)."""
        return any(h.epoch >= self._init_epoch and h.scheduler_id != self.scheduler_id
                   for h in self.health())

    def _start_epoch(self, epoch: int, keys: list[bytes]) -> None:
        """Open the epoch's streams, each with its worker's stream key (secret: it opens the
        epoch's streams and its Reset; kept nowhere else, never logged)."""
        self.epoch = epoch
        self._stream_keys = keys
        self._next_step = 0
        self._collected = -1
        peers: list[StepStream] = []     # each stream tells the others when it ends
        self._streams = [StepStream(stub, addr, peers, key)
                         for stub, addr, key in zip(self._stubs, self.addresses, keys)]
        self._failure = None

    def _close_streams(self) -> None:
        for stream in self._streams:
            stream.close()
        self._streams = []

