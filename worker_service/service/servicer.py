"""The Worker gRPC servicer: protobuf in, NodeWorker calls, protobuf out.

Runs on a synchronous grpc.server with a thread pool; the NodeWorker serializes steps, Init and
Reset over its ranks (one in-process RunnerKeeper, or a RankGroup of rank processes).

Step stream errors. A refused or failed step is answered with one StepResponse whose `error` is
set, then the stream is closed with a status (the response is skipped only for SUPERSEDED):

    failure                                   StepError.code        gRPC status
    no or a wrong credential (auth.py)        (no response)         UNAUTHENTICATED
    a client certificate not named by
      --worker-tls-allowed-clients            (no response)         PERMISSION_DENIED
    no or a wrong stream key (at the open;
      a Reset's too), a stream older than
      the epoch                               (no response)         PERMISSION_DENIED
    not initialized (no Init yet)             EPOCH_MISMATCH        FAILED_PRECONDITION
    an epoch older than the worker's          STALE_EPOCH           FAILED_PRECONDITION
    StepRequest.epoch != current epoch        EPOCH_MISMATCH        FAILED_PRECONDITION
    StepRequest.step != next step             STEP_GAP              FAILED_PRECONDITION
    a step of this epoch already failed       CODE_UNSPECIFIED      FAILED_PRECONDITION
    payload undecodable, digest wrong, a
      value out of range (batch/diff_check)  BAD_PAYLOAD           INVALID_ARGUMENT
    diff does not fit the cached requests     BAD_PAYLOAD           FAILED_PRECONDITION
    runner raised (model, device)             INTERNAL              INTERNAL
    out of device or host memory              INTERNAL              RESOURCE_EXHAUSTED
    a rank process died or stopped answering  RANK_FAILED           UNAVAILABLE
    local ranks' digests differ (verify)      SYMMETRY_DIVERGENCE   INTERNAL
    a newer Step stream was opened            (no response)         ABORTED

Init answers a stale epoch with FAILED_PRECONDITION (another scheduler owns the worker), so does
a model and KV cache estimated larger than the machine (runner/memory_fit.py), refused settings
with INVALID_ARGUMENT (the scheduler then backs off), an unsupported choice with
UNIMPLEMENTED, no memory with RESOURCE_EXHAUSTED, anything else INTERNAL (FAILURES below). Every
step failure of the active stream except an epoch mismatch, a stale epoch and supersession fails
the epoch: later steps are refused until Reset or Init. A newer Step stream supersedes the
active one at its first step of the current epoch (the older learns so at its next step). The
epoch also ends when its stream ends and no stream of it steps within a grace (orphan_watch.py).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

import grpc

from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from engine_common.configuration.lora import MAX_LORA_ID
from engine_common.request.params import clip
from engine_common.configuration.settings import from_proto
from engine_common.security.stream_key import STREAM_KEY_METADATA
from worker_service.config import RunnerConfig
from worker_service.device_info import DeviceDescription
from worker_service.failures import FailureKind, as_failure
from worker_service.config import NodeLayout
from worker_service.service.init_checks import check_lora_path
from worker_service.service.log_limit import LogLimit
from worker_service.service.node_worker import NodeWorker
from worker_service.service.step_pipeline import pipelined_steps

log = logging.getLogger(__name__)

# A failure's message in a status (a step's, an Init's, a Reset's): what one failure may say (its
# quoted values are clipped to a few hundred characters already; this bounds the whole against
# gRPC's metadata limit).
MAX_STATUS_CHARS = 2000

_Code = worker_pb2.StepError.Code
_S = grpc.StatusCode

# NOTE the one FailureKind -> (StepError code, gRPC status) table of the worker service, for Init,
# Step and Reset alike. A code of None: no StepResponse, only the status (a superseded stream).
FAILURES = {
    FailureKind.UNAUTHENTICATED: (None, _S.UNAUTHENTICATED),
    FailureKind.NOT_ALLOWED: (None, _S.PERMISSION_DENIED),
    FailureKind.NOT_INITIALIZED: (_Code.EPOCH_MISMATCH, _S.FAILED_PRECONDITION),
    FailureKind.STALE_EPOCH: (_Code.STALE_EPOCH, _S.FAILED_PRECONDITION),
    FailureKind.EPOCH_MISMATCH: (_Code.EPOCH_MISMATCH, _S.FAILED_PRECONDITION),
    FailureKind.STEP_GAP: (_Code.STEP_GAP, _S.FAILED_PRECONDITION),
    FailureKind.EPOCH_FAILED: (_Code.CODE_UNSPECIFIED, _S.FAILED_PRECONDITION),
    FailureKind.BAD_PAYLOAD: (_Code.BAD_PAYLOAD, _S.INVALID_ARGUMENT),
    FailureKind.BAD_STATE: (_Code.BAD_PAYLOAD, _S.FAILED_PRECONDITION),
    FailureKind.INTERNAL: (_Code.INTERNAL, _S.INTERNAL),
    FailureKind.RANK_FAILED: (_Code.RANK_FAILED, _S.UNAVAILABLE),
    FailureKind.SYMMETRY_DIVERGENCE: (_Code.SYMMETRY_DIVERGENCE, _S.INTERNAL),
    FailureKind.SUPERSEDED: (None, _S.ABORTED),
    FailureKind.INVALID_SETTINGS: (_Code.CODE_UNSPECIFIED, _S.INVALID_ARGUMENT),
    FailureKind.OUT_OF_MEMORY: (_Code.INTERNAL, _S.RESOURCE_EXHAUSTED),
    FailureKind.DOES_NOT_FIT: (_Code.CODE_UNSPECIFIED, _S.FAILED_PRECONDITION),
    FailureKind.UNSUPPORTED: (_Code.INTERNAL, _S.UNIMPLEMENTED),
}


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Adapts the Worker service onto a NodeWorker.

    `on_readiness(ready)` is called after every Init and Reset, and when a rank dies (the server
    feeds grpc health).
    """

    def __init__(self, worker: NodeWorker,
                 on_readiness: Callable[[bool], None] | None = None,
                 simulated_device_ms: float | None = None):
        self.worker = worker
        self.simulated_device_ms = simulated_device_ms    # host benchmarks only
        self._on_readiness = on_readiness or (lambda ready: None)
        worker.set_readiness_listener(self._on_readiness)

    def Init(self, request, context):
        try:
            config = from_proto(RunnerConfig, request.config, device=self.worker.device,
                                simulated_device_ms=self.simulated_device_ms)
            outcome = self.worker.init(config, _layout(request.layout), request.epoch,
                                       request.scheduler_id)
        except Exception as e:  # every failure becomes a status naming it
            failure = as_failure(e, at_init=True)
            if failure.kind in (FailureKind.INVALID_SETTINGS, FailureKind.STALE_EPOCH,
                                FailureKind.DOES_NOT_FIT, FailureKind.SUPERSEDED):
                log.warning("Init refused: %s", failure)   # settings, not a bug
            else:
                log.exception("Init failed")
            self._on_readiness(self.worker.readiness()[0])
            context.abort(FAILURES[failure.kind][1],
                          clip(f"Init failed: {failure}", MAX_STATUS_CHARS))
        self._on_readiness(True)
        return worker_pb2.InitResponse(
            num_kv_blocks=outcome.num_kv_blocks, epoch=request.epoch,
            kv_block_bytes=outcome.kv_block_bytes, devices=self._device_infos(),
            sliding_window=outcome.sliding_window, kv_cache_dtype=outcome.kv_cache_dtype,
            pipelined=self.worker.pipelined, stream_key=self.worker.stream_key(request.epoch),
            **_window_group_fields(outcome.window_group))

    def Step(self, request_iterator, context) -> Iterator[worker_pb2.StepResponse]:
        # The epoch's key, checked before any message is read (stream_keys.py).
        try:
            stream_id = self.worker.open_stream(_stream_key(context))
        except Exception as e:  # noqa: BLE001 - NOT_ALLOWED: no response, only the status
            _log_key_refusal(context, "Step stream")
            context.abort(FAILURES[as_failure(e).kind][1], clip(str(e), MAX_STATUS_CHARS))
        try:
            yield from self._steps(stream_id, request_iterator, context)
        finally:     # however it ended: a vanished owner's state must not stay (orphan_watch)
            self.worker.stream_ended(stream_id)

    def _steps(self, stream_id: int, request_iterator, context):
        if self.worker.pipelined:     # one rank on CUDA (or simulated): step_pipeline.py
            log.info("Step stream %d: pipelined (step t+1 launched before step t finishes)",
                     stream_id)

            def refuse(epoch, step, e):
                yield from self._refuse_step(epoch, step, e, context)
            yield from pipelined_steps(self.worker, stream_id, request_iterator, refuse)
            return
        for req in request_iterator:
            digest = req.digest if req.HasField("digest") else None
            try:
                reply = self.worker.step(stream_id, req.epoch, req.step, req.payload, digest)
            except Exception as e:  # every failure is a kind: never an UNKNOWN status
                yield from self._refuse_step(req.epoch, req.step, e, context)
            yield worker_pb2.StepResponse(epoch=req.epoch, step=req.step, payload=reply.payload,
                                          digest=reply.digest)

    def _refuse_step(self, epoch: int, step: int, e: Exception, context):
        """A failed step: its StepError response (for the kinds that have a code), then the
        call aborts with the kind's status. A failure that left the ranks out of step makes
        the worker unready until the next Init: grpc health says so too."""
        self._on_readiness(self.worker.readiness()[0])
        failure = as_failure(e)
        code, status = FAILURES[failure.kind]
        message = clip(str(failure), MAX_STATUS_CHARS)
        log.warning("Step refused: %s", message)
        if code is not None:
            yield worker_pb2.StepResponse(
                epoch=epoch, step=step,
                error=worker_pb2.StepError(code=code, message=message))
        context.abort(status, message)

    def Reset(self, request, context):
        try:
            dropped = self.worker.reset(request.epoch, request.scheduler_id,
                                        _stream_key(context))
        except Exception as e:
            failure = as_failure(e)
            if failure.kind == FailureKind.NOT_ALLOWED:
                _log_key_refusal(context, "Reset")
            elif failure.kind in (FailureKind.STALE_EPOCH, FailureKind.SUPERSEDED):
                log.warning("Reset refused: %s", failure)
            else:
                log.exception("Reset failed")
            self._on_readiness(self.worker.readiness()[0])
            context.abort(FAILURES[failure.kind][1],
                          clip(f"Reset failed: {failure}", MAX_STATUS_CHARS))
        self._on_readiness(self.worker.readiness()[0])
        return worker_pb2.ResetResponse(epoch=request.epoch, num_dropped_requests=dropped,
                                        stream_key=self.worker.stream_key(request.epoch))

    def LoadLora(self, request, context):
        """A LoRA adapter into a slot on every local rank (docs/lora.md)."""
        def load(ranks):
            check_lora_path(request.path, self.worker.guards.model_root)
            ranks.load_lora(request.lora_id, request.name, request.path)
        self._lora_call(request, context, "LoadLora", load)
        return worker_pb2.LoadLoraResponse()

    def UnloadLora(self, request, context):
        """Free a LoRA adapter slot on every local rank."""
        self._lora_call(request, context, "UnloadLora",
                        lambda ranks: ranks.unload_lora(request.lora_id))
        return worker_pb2.UnloadLoraResponse()

    def _lora_call(self, request, context, call: str, fn) -> None:
        if not 1 <= request.lora_id <= MAX_LORA_ID:
            context.abort(_S.INVALID_ARGUMENT, f"{call}: lora_id={request.lora_id} is invalid: "
                                               f"must be in [1, {MAX_LORA_ID}]")
        try:
            self.worker.owner_call(request.epoch, request.scheduler_id, _stream_key(context),
                                   call, fn)
        except Exception as e:  # noqa: BLE001 - every failure is a kind and a status
            failure = as_failure(e, at_init=True)     # a ValueError: the path's fault
            if failure.kind == FailureKind.NOT_ALLOWED:
                _log_key_refusal(context, call)
            elif failure.kind == FailureKind.INTERNAL:
                log.exception("%s failed", call)
            else:
                log.warning("%s refused: %s", call, failure)
            context.abort(FAILURES[failure.kind][1],
                          clip(f"{call} failed: {failure}", MAX_STATUS_CHARS))

    def Health(self, request, context):
        ready, reason = self.worker.readiness()
        fence = self.worker.fence
        return worker_pb2.HealthResponse(ready=ready, reason=reason, epoch=fence.epoch,
                                         scheduler_id=fence.owner)

    def Info(self, request, context):
        w = self.worker
        model = w.model_summary()
        resp = worker_pb2.InfoResponse(
            device_kind=w.device.partition(":")[0], devices=self._device_infos(),
            model_loaded=model is not None, epoch=w.fence.epoch, scheduler_id=w.fence.owner,
            num_kv_blocks=w.num_kv_blocks if model is not None else 0,
            layout=_layout_pb(w.layout), group_id=w.group_id)
        if model is not None:
            resp.model_dir = model.model_dir
            resp.attention_backend = model.attention_backend
            resp.dtype = model.dtype
        return resp

    def _device_infos(self) -> list[worker_pb2.DeviceInfo]:
        layout = self.worker.layout
        return [_device_pb(d, local_rank, layout, self.worker.num_kv_blocks)
                for local_rank, d in enumerate(self.worker.describe_devices())]


_KEY_REFUSALS = LogLimit(10.0)    # a holder of the token repeats them at will


def _stream_key(context) -> bytes | None:
    """The epoch's stream key a Step stream or Reset presents (stream_keys.py), if any."""
    key = dict(context.invocation_metadata() or ()).get(STREAM_KEY_METADATA)
    return key if isinstance(key, bytes) else None


def _log_key_refusal(context, call: str) -> None:
    skipped = _KEY_REFUSALS.take()
    if skipped is not None:
        log.warning("refused a %s from %s: no or a wrong stream key (and %d other such "
                    "refusals since the last such line)", call, ascii(context.peer())[:80],
                    skipped)


# -- protobuf <-> domain --------------------------------------------------------------------------

def _layout(pb) -> NodeLayout:
    num_local = pb.num_local_ranks or 1
    num_nodes = pb.num_nodes or 1
    layout = NodeLayout(tp_size=pb.tp_size or num_nodes * num_local, node_rank=pb.node_rank,
                        num_nodes=num_nodes, num_local_ranks=num_local,
                        rendezvous_address=pb.rendezvous_address, group_id=pb.group_id)
    if layout.tp_size != layout.num_nodes * layout.num_local_ranks:
        raise ValueError(f"layout.tp_size={layout.tp_size} is invalid: must equal num_nodes "
                         f"({num_nodes}) * num_local_ranks ({num_local})")
    if layout.node_rank >= layout.num_nodes:
        raise ValueError(f"layout.node_rank={layout.node_rank} is invalid: must be in "
                         f"[0, {layout.num_nodes - 1}]")
    return layout


def _layout_pb(layout: NodeLayout) -> worker_pb2.ParallelLayout:
    return worker_pb2.ParallelLayout(
        tp_size=layout.tp_size, node_rank=layout.node_rank, num_nodes=layout.num_nodes,
        num_local_ranks=layout.num_local_ranks, rendezvous_address=layout.rendezvous_address,
        group_id=layout.group_id)


def _device_pb(d: DeviceDescription, local_rank: int, layout: NodeLayout,
               num_kv_blocks: int) -> worker_pb2.DeviceInfo:
    return worker_pb2.DeviceInfo(
        local_rank=local_rank, global_rank=layout.node_rank * layout.num_local_ranks + local_rank,
        device_kind=d.kind, device_name=d.name, total_memory_bytes=d.total_memory_bytes,
        free_memory_bytes=d.free_memory_bytes, num_kv_blocks=num_kv_blocks)


def _window_group_fields(group) -> dict:
    """InitResponse's window-group fields of a hybrid model (none for another)."""
    if group is None:
        return {}
    return {"window_group_window": group.window, "window_group_blocks": group.num_blocks}
