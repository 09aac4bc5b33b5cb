"""The Worker gRPC servicer: protobuf in, NodeWorker calls, protobuf out.

Runs on a synchronous grpc.server with a thread pool; the NodeWorker (InProcessWorker for one rank,
RankGroupWorker for rank processes) serializes steps, Init and Reset.

Step stream errors. A refused or failed step is answered with one StepResponse whose `error` is
set, then the stream is closed with a status (the response is skipped only for SUPERSEDED):

    failure                                   StepError.code        gRPC status
    not initialized (no Init yet)             EPOCH_MISMATCH        FAILED_PRECONDITION
    StepRequest.epoch != current epoch        EPOCH_MISMATCH        FAILED_PRECONDITION
    StepRequest.step != next step             STEP_GAP              FAILED_PRECONDITION
    a step of this epoch already failed       CODE_UNSPECIFIED      FAILED_PRECONDITION
    payload undecodable or digest wrong       BAD_PAYLOAD           INVALID_ARGUMENT
    diff does not fit the cached requests     BAD_PAYLOAD           FAILED_PRECONDITION
    runner raised (model, device, OOM)        INTERNAL              INTERNAL
    a rank process died or stopped answering  RANK_FAILED           UNAVAILABLE
    local ranks' digests differ (verify)      SYMMETRY_DIVERGENCE   INTERNAL
    a newer Step stream was opened            (no response)         ABORTED

Every failure except an epoch mismatch and supersession fails the epoch: later steps are refused
until Reset or Init. A new Step stream supersedes the previous one (it learns so at its next step).
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

import grpc

from engine_common.protos import worker_pb2, worker_pb2_grpc
from worker_service.config import RunnerConfig
from worker_service.device_info import DeviceDescription
from worker_service.failures import FailureKind, StepFailure
from worker_service.service.node_worker import NodeLayout, NodeWorker

log = logging.getLogger(__name__)

_Code = worker_pb2.StepError.Code
_S = grpc.StatusCode

# FailureKind -> (StepError code or None for no response, stream status)
_STEP_FAILURES = {
    FailureKind.NOT_INITIALIZED: (_Code.EPOCH_MISMATCH, _S.FAILED_PRECONDITION),
    FailureKind.EPOCH_MISMATCH: (_Code.EPOCH_MISMATCH, _S.FAILED_PRECONDITION),
    FailureKind.STEP_GAP: (_Code.STEP_GAP, _S.FAILED_PRECONDITION),
    FailureKind.EPOCH_FAILED: (_Code.CODE_UNSPECIFIED, _S.FAILED_PRECONDITION),
    FailureKind.BAD_PAYLOAD: (_Code.BAD_PAYLOAD, _S.INVALID_ARGUMENT),
    FailureKind.BAD_STATE: (_Code.BAD_PAYLOAD, _S.FAILED_PRECONDITION),
    FailureKind.INTERNAL: (_Code.INTERNAL, _S.INTERNAL),
    FailureKind.RANK_FAILED: (_Code.RANK_FAILED, _S.UNAVAILABLE),
    FailureKind.SYMMETRY_DIVERGENCE: (_Code.SYMMETRY_DIVERGENCE, _S.INTERNAL),
    FailureKind.SUPERSEDED: (None, _S.ABORTED),
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The one exception -> gRPC status rule of the worker service."""
    if isinstance(exc, StepFailure):
        return _STEP_FAILURES[exc.kind][1]
    if isinstance(exc, NotImplementedError):
        return _S.UNIMPLEMENTED
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return _S.RESOURCE_EXHAUSTED
    if isinstance(exc, ValueError):
        return _S.INVALID_ARGUMENT
    return _S.INTERNAL


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Adapts the Worker service onto a NodeWorker.

    `on_readiness(ready)` is called after every Init and Reset, and when a rank dies (the server
    feeds grpc health).
    """

    def __init__(self, worker: NodeWorker,
                 on_readiness: Callable[[bool], None] | None = None):
        self.worker = worker
        self._on_readiness = on_readiness or (lambda ready: None)
        worker.set_readiness_listener(self._on_readiness)

    def Init(self, request, context):
        try:
            config, layout, util = _init_args(request, self.worker.device)
            outcome = self.worker.init(config, layout, request.epoch, util,
                                       request.verify_symmetry)
        except Exception as e:  # every failure becomes a status naming it
            if status_for(e) == grpc.StatusCode.INVALID_ARGUMENT:
                log.warning("Init refused: %s: %s", type(e).__name__, e)   # settings, not a bug
            else:
                log.exception("Init failed")
            self._on_readiness(self.worker.readiness()[0])
            context.abort(status_for(e), f"Init failed: {type(e).__name__}: {e}")
        self._on_readiness(True)
        return worker_pb2.InitResponse(
            num_kv_blocks=outcome.num_kv_blocks, epoch=request.epoch,
            kv_block_bytes=outcome.kv_block_bytes, devices=self._device_infos())

    def Step(self, request_iterator, context) -> Iterator[worker_pb2.StepResponse]:
        stream_id = self.worker.open_stream()
        for req in request_iterator:
            digest = req.digest if req.HasField("digest") else None
            try:
                reply = self.worker.step(stream_id, req.epoch, req.step, req.payload, digest)
            except StepFailure as failure:
                code, status = _STEP_FAILURES[failure.kind]
                log.warning("Step refused: %s", failure)
                if code is not None:
                    yield worker_pb2.StepResponse(
                        epoch=req.epoch, step=req.step,
                        error=worker_pb2.StepError(code=code, message=str(failure)))
                context.abort(status, str(failure))
            yield worker_pb2.StepResponse(epoch=req.epoch, step=req.step, payload=reply.payload,
                                          digest=reply.digest)

    def Reset(self, request, context):
        try:
            dropped = self.worker.reset(request.epoch)
        except Exception as e:
            log.exception("Reset failed")
            self._on_readiness(self.worker.readiness()[0])
            context.abort(status_for(e), f"Reset failed: {type(e).__name__}: {e}")
        self._on_readiness(self.worker.readiness()[0])
        return worker_pb2.ResetResponse(epoch=request.epoch, num_dropped_requests=dropped)

    def Health(self, request, context):
        ready, reason = self.worker.readiness()
        return worker_pb2.HealthResponse(ready=ready, reason=reason)

    def Info(self, request, context):
        w = self.worker
        model = w.model_summary()
        resp = worker_pb2.InfoResponse(
            device_kind=w.device.partition(":")[0], devices=self._device_infos(),
            model_loaded=model is not None, epoch=w.epoch or 0,
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


# -- protobuf <-> domain --------------------------------------------------------------------------

def _init_args(req, device: str) -> tuple[RunnerConfig, NodeLayout, float | None]:
    """RunnerConfig, layout and GPU memory fraction from an InitRequest (0 / "" = default)."""
    if not req.model_dir:
        raise ValueError("model_dir is required (got an empty string)")
    defaults = RunnerConfig(model_dir=req.model_dir)
    budget = req.WhichOneof("kv_budget")
    util = req.gpu_memory_utilization if budget == "gpu_memory_utilization" else None
    if util is not None and not 0.0 < util <= 1.0:
        raise ValueError(f"gpu_memory_utilization={util} is invalid: must be in (0, 1]")
    config = RunnerConfig(
        model_dir=req.model_dir, device=device,
        dtype=None if req.dtype in ("", "auto") else req.dtype,
        attention_backend=req.attention_backend or "auto",
        block_size=req.block_size or defaults.block_size,
        max_model_len=req.max_model_len or None,
        max_num_seqs=req.max_num_seqs or defaults.max_num_seqs,
        max_num_batched_tokens=req.max_num_batched_tokens or defaults.max_num_batched_tokens,
        kv_cache_bytes=req.kv_cache_bytes if budget == "kv_cache_bytes"
        else defaults.kv_cache_bytes,
        enforce_eager=req.enforce_eager, fused_ops=req.fused_ops,
        max_graph_batch=req.max_graph_batch or defaults.max_graph_batch)
    return config, _layout(req.layout), util


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
