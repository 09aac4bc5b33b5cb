"""A token holder cannot grow a worker's cache of requests without bound: preempted requests
stay cached (they hold no KV blocks), so preempting a full batch and sending a new one every
step grew it by max_num_seqs requests a step, for good. The worker now refuses, as BAD_PAYLOAD,
a diff that would cache more than max_num_seqs + the ceiling of the scheduler's max_waiting
(engine_common/request/diff_limits.max_cached_requests), and a finished or preempted list longer
than any legal one, before looking at its handles. A real worker service on loopback with the
tiny model; the ceiling is lowered to 2 for the test (4 + 2 = 6 cached requests)."""
from __future__ import annotations

import grpc
import pytest

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.request import diff_limits
from engine_common.security.worker_auth import WorkerAuth
from engine_common.wire.diff import SchedulerOutput
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from scheduler_service.workers.worker_client import WorkerClient
from tests.support.garbage_diffs import enc, new
from tests.support.grpc_harness import keyed
from tests.support.init_specs import init_spec
from worker_service.service.server import serve_worker

TOKEN = "test-token-0123456789abcdef"
LIMITS = dict(block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64)
CEILING = 2                     # the test's MAX_WAITING: at most 4 + 2 cached requests
FULL_BATCH = SchedulerOutput(0, new_requests=[new(h, [3, 14, 15], [h]) for h in range(4)])


@pytest.fixture(scope="module")
def worker(tiny_models):
    """(address, client, node worker) of a worker initialized with MAX_WAITING lowered to
    CEILING."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(diff_limits, "MAX_WAITING", CEILING)
        server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"),
                              WorkerAuth(token=TOKEN))
        address = f"127.0.0.1:{server.bound_port}"
        client = WorkerClient([address], connect_timeout_s=60, auth=WorkerAuth(token=TOKEN))
        try:
            client.init(init_spec(tiny_models("qwen3"), dtype="float32", kv_cache_bytes=1 << 20,
                                  **LIMITS))
            yield address, client, server.node_worker
        finally:
            client.close()
            server.stop(None)
            server.node_worker.close()


def _run(worker, diffs: list[SchedulerOutput]):
    """(responses, final status) of a fresh epoch's Step stream carrying `diffs`."""
    address, client, node_worker = worker
    client.reset()
    key = node_worker.stream_key(client.epoch)
    requests = [worker_pb2.StepRequest(epoch=client.epoch, step=d.step, payload=enc(d))
                for d in diffs]
    responses = []
    with grpc.insecure_channel(address) as channel:
        try:
            for r in worker_pb2_grpc.WorkerStub(channel).Step(iter(requests), timeout=60,
                                                             metadata=keyed(TOKEN, key)):
                responses.append(r)
        except grpc.RpcError as e:
            return responses, e.code()
    return responses, grpc.StatusCode.OK


def _refused(worker, diffs: list[SchedulerOutput]) -> str:
    """The BAD_PAYLOAD message the last diff got (every one before it ran)."""
    responses, status = _run(worker, diffs)
    assert len(responses) == len(diffs), status
    assert not any(r.HasField("error") for r in responses[:-1])
    error = responses[-1].error
    assert error.code == worker_pb2.StepError.BAD_PAYLOAD, error
    assert status == grpc.StatusCode.INVALID_ARGUMENT
    return error.message


def test_preempting_a_full_batch_for_new_requests_is_refused_past_the_bound(worker):
    # 4 preempted + 2 new = 6 cached: allowed.
    responses, status = _run(worker, [FULL_BATCH, SchedulerOutput(
        1, preempted_handles=[0, 1, 2, 3], new_requests=[new(h, [3, 14], [h]) for h in (4, 5)])])
    assert status == grpc.StatusCode.OK and not any(r.HasField("error") for r in responses)
    # 4 preempted + 4 new = 8: refused, naming the count and the bound.
    message = _refused(worker, [FULL_BATCH, SchedulerOutput(
        1, preempted_handles=[0, 1, 2, 3],
        new_requests=[new(h, [3, 14], [h]) for h in (4, 5, 6, 7)])])
    assert "cached requests after the diff=8 is invalid: must be <= 6" in message, message


def test_leaving_lists_longer_than_any_legal_one_are_refused_by_count(worker):
    message = _refused(worker, [FULL_BATCH, SchedulerOutput(1, finished_handles=[0] * 7)])
    assert "finished_handles length=7 is invalid: must be <= max_cached_requests (6)" in message
    message = _refused(worker, [FULL_BATCH, SchedulerOutput(1, preempted_handles=[0] * 5)])
    assert "preempted_handles length=5 is invalid: must be <= max_num_seqs (4)" in message
