"""A step refused STALE_EPOCH means another scheduler took the worker over only when the worker
says so; a new epoch under this scheduler's own id from elsewhere (an operator's grpcurl Init
with the owner's id from Info; a Reset needs the epoch's stream key since session 41) is a failed
step, not a takeover.

The client raised Fenced on every STALE_EPOCH: the engine then failed every stream with "another
scheduler took the workers over", turned NOT_SERVING and never built a core again, although no
other scheduler existed. Now it asks the worker's Health first, as a refused Init does: another
owner at a higher epoch is Fenced; its own id is a WorkerFailure, and the next init serves."""
from __future__ import annotations

import pytest

from engine_common.wire.protos import worker_pb2
from scheduler_service.errors import Fenced, WorkerFailure
from scheduler_service.workers.worker_client import WorkerClient


class StaleReply:
    """A stream whose reply is STALE_EPOCH, as the worker sends it."""

    def receive(self, epoch, step, deadline):
        raise Fenced(f"worker w: step {step} failed: STALE_EPOCH: step {step} carries epoch "
                     f"{epoch}, which is stale: the worker's epoch is {epoch + 1}", kind="stale")

    def close(self):
        pass


class Health:
    """The worker's Health RPC (as a future): its epoch and owner now."""

    def __init__(self, epoch: int, scheduler_id: str):
        self.reply = worker_pb2.HealthResponse(ready=True, epoch=epoch, scheduler_id=scheduler_id)

    def future(self, request, timeout):
        return self

    def result(self):
        return self.reply


class Stub:
    def __init__(self, epoch: int, scheduler_id: str):
        self.Health = Health(epoch, scheduler_id)


def _client(owner: str, worker_epoch: int) -> WorkerClient:
    client = WorkerClient(["127.0.0.1:1"], connect_timeout_s=1, step_timeout_s=1,
                          scheduler_id="me")
    client._stubs, client._streams = [Stub(worker_epoch, owner)], [StaleReply()]
    client.epoch = client.owned_epoch = client._init_epoch = 7
    client._failure, client._next_step = None, 1
    return client


def test_a_reset_of_its_own_epoch_is_a_failed_step_not_a_takeover():
    client = _client(owner="me", worker_epoch=8)
    with pytest.raises(WorkerFailure) as failure:
        client.collect(0)
    assert not isinstance(failure.value, Fenced), failure.value
    assert "STALE_EPOCH" in str(failure.value) and "still owns" in str(failure.value)


def test_another_owner_at_a_higher_epoch_is_a_takeover():
    client = _client(owner="newer", worker_epoch=8)
    with pytest.raises(Fenced, match="STALE_EPOCH"):
        client.collect(0)
