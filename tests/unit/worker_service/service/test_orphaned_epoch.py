"""A scheduler that vanishes leaves nothing cached on its worker for long: once the Step stream
that runs the epoch ends and no stream of the epoch steps within the grace, the worker drops
every cached request and zeroes the KV cache (service/orphan_watch.py). Before, a killed
scheduler's requests, batch rows and KV stayed until the next Init, which might never come.

A new stream of the same epoch within the grace keeps everything (a scheduler may reconnect).
A real worker service on loopback with the tiny model; the grace's timer is replaced by a list
the test fires itself (no sleeping)."""
from __future__ import annotations

import queue

import grpc
import pytest

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.security.worker_auth import WorkerAuth
from engine_common.wire.diff import SchedulerOutput
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from tests.support.garbage_diffs import enc, new
from tests.support.grpc_harness import bearer, keyed
from worker_service.service.server import serve_worker

TOKEN = "test-token-0123456789abcdef"
LIMITS = dict(dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, kv_cache_bytes=1 << 20)
PROMPT = [3, 14, 15, 92, 65, 35]
PREFILL = SchedulerOutput(0, new_requests=[new(0, PROMPT, [0, 1])],
                          num_scheduled_tokens={0: len(PROMPT)})
DECODE = SchedulerOutput(1)          # handle 0's next token


class Timers:
    """call_later that records; `fire()` runs what is due (the test decides when time passed).
    `ended` gets the id of every Step stream whose handler is done."""

    def __init__(self):
        self.pending: list = []
        self.ended: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, delay_s, fn):
        self.pending.append(fn)

    def wait_stream_end(self) -> None:
        """An event, waited for with a timeout only against a hang."""
        self.ended.get(timeout=60)

    def fire(self) -> None:
        due, self.pending = self.pending, []
        for fn in due:
            fn()


class Stream:
    """One Step stream whose requests the test sends one at a time."""

    def __init__(self, stub, epoch: int, key: bytes):
        self.epoch = epoch
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Step(iter(self._requests.get, None), timeout=120,
                              metadata=keyed(TOKEN, key))

    def step(self, diff: SchedulerOutput) -> worker_pb2.StepResponse:
        self._requests.put(worker_pb2.StepRequest(epoch=self.epoch, step=diff.step,
                                                  payload=enc(diff)))
        return next(self.call)


@pytest.fixture
def worker(tiny_models):
    """(stub, node worker, timers, epoch 1's stream key) of a worker Inited at epoch 1 by
    scheduler A."""
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"),
                          WorkerAuth(token=TOKEN))
    timers = Timers()
    node_worker = server.node_worker
    node_worker.orphans.call_later = timers
    stream_ended = node_worker.stream_ended

    def spy(stream_id: int) -> None:
        stream_ended(stream_id)
        timers.ended.put(stream_id)
    node_worker.stream_ended = spy
    channel = grpc.insecure_channel(f"127.0.0.1:{server.bound_port}")
    stub = worker_pb2_grpc.WorkerStub(channel)
    config = worker_pb2.WorkerConfig(model_dir=tiny_models("qwen3"), **LIMITS)
    key = stub.Init(worker_pb2.InitRequest(epoch=1, scheduler_id="A", config=config),
                    timeout=120, metadata=bearer(TOKEN)).stream_key
    try:
        yield stub, server.node_worker, timers, key
    finally:
        channel.close()
        server.stop(None)
        server.node_worker.close()


def _cached(node_worker) -> int:
    return len(node_worker.ranks.runner.requests)


def _vanish(stream: Stream, timers: Timers) -> None:
    """The scheduler dies: its stream is cancelled; the worker's handler ends and arms the
    grace."""
    stream.call.cancel()
    timers.wait_stream_end()
    assert len(timers.pending) == 1


def test_a_vanished_owners_requests_and_kv_are_dropped_after_the_grace(worker):
    stub, node_worker, timers, key = worker
    owner = Stream(stub, 1, key)
    assert not owner.step(PREFILL).HasField("error")
    assert _cached(node_worker) == 1
    _vanish(owner, timers)
    assert _cached(node_worker) == 1          # within the grace: kept
    timers.fire()                            # the grace is over, no stream came
    assert _cached(node_worker) == 0
    assert all(not c.any() for c in node_worker.ranks.runner.kv_caches)
    # A stream of the epoch that comes later is told why its requests are gone.
    late = Stream(stub, 1, key).step(DECODE)
    assert late.error.code == worker_pb2.StepError.CODE_UNSPECIFIED, late.error
    assert "Step stream of epoch 1 ended" in late.error.message
    assert "its 1 cached requests were dropped" in late.error.message


def test_a_stream_of_the_epoch_within_the_grace_keeps_everything(worker):
    stub, node_worker, timers, key = worker
    owner = Stream(stub, 1, key)
    first = owner.step(PREFILL)
    _vanish(owner, timers)
    again = Stream(stub, 1, key)                  # the scheduler reconnects at the same epoch
    second = again.step(DECODE)
    assert not second.HasField("error"), second.error
    timers.fire()                            # the old grace runs out after the new stream stepped
    assert _cached(node_worker) == 1
    assert not again.step(SchedulerOutput(2)).HasField("error")
    assert first.step == 0 and second.step == 1


def test_the_old_owners_stream_ending_after_a_takeover_drops_nothing_of_the_new(worker,
                                                                                tiny_models):
    stub, node_worker, timers, key = worker
    old = Stream(stub, 1, key)
    old.step(PREFILL)
    config = worker_pb2.WorkerConfig(model_dir=tiny_models("qwen3"), **LIMITS)
    key_b = stub.Init(worker_pb2.InitRequest(epoch=2, scheduler_id="B", config=config),
                      timeout=120, metadata=bearer(TOKEN)).stream_key
    new_owner = Stream(stub, 2, key_b)
    new_owner.step(PREFILL)
    with pytest.raises(grpc.RpcError):       # the old owner learns it was fenced
        old.step(DECODE)
    timers.wait_stream_end()
    assert not timers.pending                # the fenced stream is not the epoch's
    timers.fire()
    assert _cached(node_worker) == 1         # B's request stays
    assert not new_owner.step(DECODE).HasField("error")
