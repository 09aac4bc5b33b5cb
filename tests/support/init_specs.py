"""InitSpecs for tests: the worker settings as keywords, the group settings beside them."""
from __future__ import annotations

from engine_common.configuration.config import WorkerConfig
from engine_common.configuration.settings import to_proto
from engine_common.wire.protos import worker_pb2
from scheduler_service.workers.worker_spec import InitSpec

_GROUP_FIELDS = ("num_local_ranks", "rendezvous_address", "dist_port")


def init_spec(model_dir: str, **fields) -> InitSpec:
    """InitSpec(WorkerConfig(model_dir, **worker fields), **group fields)."""
    group = {k: fields.pop(k) for k in _GROUP_FIELDS if k in fields}
    return InitSpec(WorkerConfig(model_dir=model_dir, **fields), **group)


def init_request(spec: InitSpec, epoch: int, scheduler_id: str):
    """The InitRequest a scheduler sends for `spec` on one node (tp 1), for tests that drive a
    worker themselves: its reply carries the epoch's stream key, as it does for the scheduler."""
    request = worker_pb2.InitRequest(epoch=epoch, scheduler_id=scheduler_id)
    to_proto(spec.config, request.config)
    return request
