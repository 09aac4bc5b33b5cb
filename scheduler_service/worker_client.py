"""The scheduler's side of the Worker protocol: Init every worker, then stream each step to all.

Torch-free. One WorkerClient talks to every worker service (node) of one model replica; the worker
at `addresses[0]` is node 0, which holds the output rank and answers with the RunnerOutput; the
others answer with empty acknowledgements.

    init(spec)  -> new random epoch; Init on all workers at once (tensor-parallel ranks rendezvous
                   inside Init, so the calls must overlap); then one Step stream per worker
    execute(p)  -> StepRequest(epoch, step, p) to every worker, step = 0, 1, 2, ... per epoch;
                   wait for every reply; return node 0's payload

Any failure (unreachable worker, broken stream, StepError, no reply within `step_timeout_s`)
raises WorkerFailure naming the worker, and fails the client until the next `init` or `reset`.
Use init/execute/reset/close from one thread; `health` may be called from any thread.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import grpc

from engine_common.params import ParamError
from engine_common.protos import worker_pb2, worker_pb2_grpc
from scheduler_service.errors import WorkerFailure
from scheduler_service.worker_stream import StepStream, describe_rpc_error


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


@dataclass(frozen=True)
class InitSpec:
    """What every worker loads. 0 / "auto" / None take the worker's or the model's default.

    Exactly one KV budget applies: `kv_cache_bytes` (per rank), or `gpu_memory_utilization` (the
    fraction of each GPU the worker may use in all); neither takes the worker's default.
    """

    model_dir: str
    dtype: str = "auto"
    attention_backend: str = "auto"
    max_model_len: int = 0
    block_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Tensor-parallel layout: every worker runs `num_local_ranks` ranks; tp_size is
    # len(addresses) * num_local_ranks. "" rendezvous: the workers' default (node 0's host).
    num_local_ranks: int = 1
    rendezvous_address: str = ""
    verify_symmetry: bool = False

    def __post_init__(self):
        if not self.model_dir:
            raise ParamError("model_dir", self.model_dir, "a non-empty path")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ParamError("block_size", self.block_size, "a power of two >= 1")
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_local_ranks"):
            if getattr(self, name) < 1:
                raise ParamError(name, getattr(self, name), ">= 1")
        if self.max_model_len < 0:
            raise ParamError("max_model_len", self.max_model_len, ">= 0 (0: the model's)")
        if self.kv_cache_bytes is not None and self.gpu_memory_utilization is not None:
            raise ParamError("gpu_memory_utilization", self.gpu_memory_utilization,
                             "unset when kv_cache_bytes is set (one KV budget)")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ParamError("kv_cache_bytes", self.kv_cache_bytes, ">= 1")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ParamError("gpu_memory_utilization", util, "in (0, 1]")


@dataclass(frozen=True)
class WorkerDevice:
    """One rank's device as a worker reported it in Init."""

    address: str
    node_rank: int
    local_rank: int
    global_rank: int
    kind: str
    name: str
    total_memory_bytes: int
    free_memory_bytes: int
    num_kv_blocks: int


@dataclass(frozen=True)
class InitResult:
    epoch: int
    num_kv_blocks: int      # the minimum over all workers
    kv_block_bytes: int     # per rank
    devices: tuple[WorkerDevice, ...]


@dataclass(frozen=True)
class WorkerHealth:
    address: str
    ready: bool
    reason: str


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
        self._next_step = 0
        self._failure: str | None = "not initialized: call init() first"

    # -- lifecycle ------------------------------------------------------------------------------

    def init(self, spec: InitSpec) -> InitResult:
        """Start a new epoch on every worker with `spec`; open the Step streams."""
        self._close_streams()
        self._failure = "an init() did not complete"
        self._wait_ready()
        epoch = _new_epoch()
        calls = [stub.Init.future(_init_request(spec, epoch, node, len(self.addresses)),
                                  timeout=self.init_timeout_s)
                 for node, stub in enumerate(self._stubs)]
        replies = [self._result(call, addr, "Init") for call, addr in zip(calls, self.addresses)]
        self._start_epoch(epoch)
        devices = tuple(_device(d, addr, node) for node, (addr, r) in
                        enumerate(zip(self.addresses, replies)) for d in r.devices)
        return InitResult(epoch=epoch, num_kv_blocks=min(r.num_kv_blocks for r in replies),
                          kv_block_bytes=replies[0].kv_block_bytes, devices=devices)

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
        except WorkerFailure as e:
            self._fail(str(e))
            raise
        return replies[0]

    # -- helpers --------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise WorkerFailure(f"the worker client is unusable: {self._failure}")

    def _fail(self, reason: str) -> None:
        self._failure = reason
        self._close_streams()

    def _wait_ready(self) -> None:
        """Wait up to connect_timeout_s for every worker to answer (a Health call that waits for
        the connection; channel_ready_future would leave a polling thread behind)."""
        calls = [stub.Health.future(worker_pb2.HealthRequest(), wait_for_ready=True,
                                    timeout=self.connect_timeout_s) for stub in self._stubs]
        for call, addr in zip(calls, self.addresses):
            try:
                call.result()
            except grpc.RpcError as e:
                raise WorkerFailure(f"worker {addr}: not reachable within "
                                    f"{self.connect_timeout_s:g}s ({describe_rpc_error(e)})"
                                    ) from None

    def _result(self, call, addr: str, rpc: str):
        try:
            return call.result()
        except grpc.RpcError as e:
            raise WorkerFailure(f"worker {addr}: {rpc} failed: {describe_rpc_error(e)}") from e

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


def _init_request(spec: InitSpec, epoch: int, node_rank: int,
                  num_nodes: int) -> worker_pb2.InitRequest:
    req = worker_pb2.InitRequest(
        model_dir=spec.model_dir, dtype=spec.dtype,
        attention_backend="" if spec.attention_backend == "auto" else spec.attention_backend,
        max_model_len=spec.max_model_len, block_size=spec.block_size, epoch=epoch,
        max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
        verify_symmetry=spec.verify_symmetry,
        layout=worker_pb2.ParallelLayout(
            tp_size=num_nodes * spec.num_local_ranks, node_rank=node_rank, num_nodes=num_nodes,
            num_local_ranks=spec.num_local_ranks, rendezvous_address=spec.rendezvous_address))
    if spec.kv_cache_bytes is not None:
        req.kv_cache_bytes = spec.kv_cache_bytes
    elif spec.gpu_memory_utilization is not None:
        req.gpu_memory_utilization = spec.gpu_memory_utilization
    return req


def _device(d, address: str, node_rank: int) -> WorkerDevice:
    return WorkerDevice(address=address, node_rank=node_rank, local_rank=d.local_rank,
                        global_rank=d.global_rank, kind=d.device_kind, name=d.device_name,
                        total_memory_bytes=d.total_memory_bytes,
                        free_memory_bytes=d.free_memory_bytes, num_kv_blocks=d.num_kv_blocks)
