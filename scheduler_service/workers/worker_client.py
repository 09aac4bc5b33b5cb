"""The scheduler's side of the Worker protocol: Init every worker, then stream each step to all.

Torch-free. One WorkerClient talks to every worker service (node) of one model replica; the worker
at `addresses[0]` is node 0, which holds the output rank and answers with the RunnerOutput; the
others answer with empty acknowledgements.

    init(spec)  -> Info from every worker (how it was started); plan the group (group_plan.py);
                   new random epoch; Init on all workers at once (tensor-parallel ranks
                   rendezvous inside Init, so the calls must overlap; the first failure cancels
                   the rest); then one Step stream per worker
    execute(p)  -> StepRequest(epoch, step, p) to every worker (once per node, never per rank;
                   the bytes do not depend on the TP size), step = 0, 1, 2, ... per epoch;
                   wait for every reply; return node 0's payload. With verify_symmetry every
                   node's digest must be equal, else SymmetryError (and the next init re-forms
                   the process group)

Any failure (unreachable worker, broken stream, StepError, no reply within `step_timeout_s`)
raises WorkerFailure naming the worker, and fails the client until the next `init` or `reset`.
Use init/execute/reset/close from one thread; `health` may be called from any thread.
"""
from __future__ import annotations

import queue
import secrets
import time

import grpc

from engine_common.params import ParamError
from engine_common.protos import worker_pb2, worker_pb2_grpc
from engine_common.settings import to_proto
from scheduler_service.errors import WorkerFailure, WorkerRefused
from scheduler_service.workers.group_plan import plan_group
from scheduler_service.workers.worker_spec import (DEFAULT_DIST_PORT, InitResult, InitSpec,
                                                   WorkerDevice, WorkerHealth)
from scheduler_service.workers.worker_stream import StepStream, SymmetryError, describe_rpc_error

__all__ = ["DEFAULT_DIST_PORT", "InitResult", "InitSpec", "SymmetryError", "WorkerClient",
           "WorkerDevice", "WorkerHealth"]



# Large payloads (whole prompts), keepalive pings every few seconds so a dead link is noticed,
# and quick reconnects so a restarted worker is found again within a second or two.
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
    ("grpc.keepalive_time_ms", 5_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)


class WorkerClient:
    """Client of every worker service of one replica; implements the engine's StepExecutor."""

    def __init__(self, addresses: list[str], connect_timeout_s: float = 5.0,
                 step_timeout_s: float = 120.0, init_timeout_s: float = 600.0):
        if not addresses:
            raise ParamError("addresses", addresses, "at least one HOST:PORT")
        self.addresses = list(addresses)
        self.connect_timeout_s = connect_timeout_s
        self.step_timeout_s = step_timeout_s
        self.init_timeout_s = init_timeout_s
        self._channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
        self._stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        self._streams: list[StepStream] = []
        self.epoch: int | None = None
        self.verify_symmetry = False
        self._next_step = 0
        self._failure: str | None = "not initialized: call init() first"
        self._force_new_group = False

    # -- lifecycle ------------------------------------------------------------------------------

    def init(self, spec: InitSpec) -> InitResult:
        """Start a new epoch on every worker with `spec`; open the Step streams."""
        self._close_streams()
        self._failure = "an init() did not complete"
        plan = plan_group(self.addresses, self._wait_ready(),
                          num_local_ranks=spec.num_local_ranks,
                          rendezvous_address=spec.rendezvous_address, dist_port=spec.dist_port,
                          force_new=self._force_new_group)
        epoch = _new_epoch()
        calls = [stub.Init.future(_init_request(spec, epoch, plan.layout_pb(node)),
                                  timeout=self.init_timeout_s)
                 for node, stub in enumerate(self._stubs)]
        replies = self._all_results(calls, "Init")
        self._force_new_group = False
        self.verify_symmetry = spec.config.verify_symmetry
        self._start_epoch(epoch)
        devices = tuple(_device(d, addr, node) for node, (addr, r) in
                        enumerate(zip(self.addresses, replies)) for d in r.devices)
        return InitResult(epoch=epoch, num_kv_blocks=min(r.num_kv_blocks for r in replies),
                          kv_block_bytes=replies[0].kv_block_bytes, devices=devices,
                          tp_size=plan.tp_size, group_id=plan.group_id)

    def reset(self) -> int:
        """Start a new epoch on every worker; returns how many cached requests node 0 dropped."""
        self._close_streams()
        self._failure = "a reset() did not complete"
        epoch = _new_epoch()
        calls = [stub.Reset.future(worker_pb2.ResetRequest(epoch=epoch),
                                   timeout=self.connect_timeout_s) for stub in self._stubs]
        replies = [self._result(call, addr, "Reset") for call, addr in zip(calls, self.addresses)]
        self._start_epoch(epoch)
        return replies[0].num_dropped_requests

    def close(self) -> None:
        """End the streams and close the channels."""
        self._close_streams()
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
                out.append(WorkerHealth(addr, reply.ready, reply.reason))
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
        for stream in self._streams:
            stream.send(request)
        return step

    def collect(self, step: int) -> bytes:
        """Wait for every worker's reply to `step` (the oldest one in flight)."""
        self._check_usable()
        deadline = time.monotonic() + self.step_timeout_s
        try:
            replies = [s.receive(self.epoch, step, deadline) for s in self._streams]
            if self.verify_symmetry:
                self._check_symmetry(step, replies)
        except WorkerFailure as e:
            self._force_new_group |= isinstance(e, SymmetryError)
            self._fail(str(e))
            raise
        return replies[0].payload

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
            kind = (WorkerRefused if rpc == "Init" and e.code() == grpc.StatusCode.INVALID_ARGUMENT
                    else WorkerFailure)
            raise kind(f"worker {addr}: {rpc} failed: {describe_rpc_error(e)}") from e

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._next_step = 0
        self._streams = [StepStream(stub, addr) for stub, addr in zip(self._stubs, self.addresses)]
        self._failure = None

    def _close_streams(self) -> None:
        for stream in self._streams:
            stream.close()
        self._streams = []


def _new_epoch() -> int:
    """A fresh random 63-bit epoch, never 0."""
    return secrets.randbits(63) or 1


def _init_request(spec: InitSpec, epoch: int,
                  layout: worker_pb2.ParallelLayout) -> worker_pb2.InitRequest:
    req = worker_pb2.InitRequest(epoch=epoch, layout=layout)
    to_proto(spec.config, req.config)
    return req


def _device(d, address: str, node_rank: int) -> WorkerDevice:
    return WorkerDevice(address=address, node_rank=node_rank, local_rank=d.local_rank,
                        global_rank=d.global_rank, kind=d.device_kind, name=d.device_name,
                        total_memory_bytes=d.total_memory_bytes,
                        free_memory_bytes=d.free_memory_bytes, num_kv_blocks=d.num_kv_blocks)
