"""InitSpecs for tests: the worker settings as keywords, the group settings beside them."""
from __future__ import annotations

from engine_common.configuration.config import WorkerConfig
from scheduler_service.workers.worker_spec import InitSpec

_GROUP_FIELDS = ("num_local_ranks", "rendezvous_address", "dist_port")


def init_spec(model_dir: str, **fields) -> InitSpec:
    """InitSpec(WorkerConfig(model_dir, **worker fields), **group fields)."""
    group = {k: fields.pop(k) for k in _GROUP_FIELDS if k in fields}
    return InitSpec(WorkerConfig(model_dir=model_dir, **fields), **group)
