"""A holder of the worker token who is not the epoch's owner cannot read the owner's requests
(service/stream_keys.py). Before, "within one epoch the token is the trust boundary": the caller
read the owner's epoch from Info, opened a Step stream of it and learnt the next step number
from STEP_GAP; its first step superseded the owner's stream and ran the owner's requests, its
reply carrying the owner's next tokens. Now a Step stream must present the key only the Init's
caller got: an impostor's stream is refused PERMISSION_DENIED when it opens, supersedes nothing
and learns nothing; so is its Reset with the owner's id from Info, which used to wipe the owner's
cache. A real worker service on loopback with the tiny model."""
from __future__ import annotations

import queue
import secrets

import grpc
import pytest

from engine_common.configuration.config import WorkerServiceOptions
from engine_common.security.worker_auth import WorkerAuth
from engine_common.wire.codec import decode_runner_output
from engine_common.wire.diff import SchedulerOutput
from engine_common.wire.protos import worker_pb2, worker_pb2_grpc
from tests.support.garbage_diffs import enc, new
from tests.support.grpc_harness import bearer, keyed
from worker_service.service.server import serve_worker

TOKEN = "test-token-0123456789abcdef"
LIMITS = dict(dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=64, kv_cache_bytes=1 << 20)
PROMPTS = ([3, 14, 15, 92, 65, 35], [2, 71, 82, 81, 82])
PREFILL = SchedulerOutput(0, new_requests=[new(0, PROMPTS[0], [0, 1]),
                                           new(1, PROMPTS[1], [2, 3])],
                          num_scheduled_tokens={0: len(PROMPTS[0]), 1: len(PROMPTS[1])})


class Stream:
    """One Step stream whose requests the test sends one at a time."""

    def __init__(self, stub, metadata: tuple):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.Step(iter(self._requests.get, None), timeout=120, metadata=metadata)

    def step(self, epoch: int, diff: SchedulerOutput) -> worker_pb2.StepResponse:
        self._requests.put(worker_pb2.StepRequest(epoch=epoch, step=diff.step,
                                                  payload=enc(diff)))
        return next(self.call)


@pytest.fixture(scope="module")
def server(tiny_models):
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu"),
                          WorkerAuth(token=TOKEN))
    try:
        yield server
    finally:
        server.stop(None)
        server.node_worker.close()


@pytest.fixture
def worker(server, tiny_models):
    """(stub, the owner's stream key, its epoch) of the worker, Inited anew by "owner"."""
    with grpc.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        epoch = server.node_worker.fence.epoch + 1
        config = worker_pb2.WorkerConfig(model_dir=tiny_models("qwen3"), **LIMITS)
        reply = stub.Init(worker_pb2.InitRequest(epoch=epoch, scheduler_id="owner",
                                                 config=config),
                          timeout=120, metadata=bearer(TOKEN))
        yield stub, reply.stream_key, epoch


def _tokens(reply: worker_pb2.StepResponse) -> list[int]:
    assert not reply.HasField("error"), reply.error
    return list(decode_runner_output(reply.payload).sampled_token_ids)


def _refused(stream: Stream, epoch: int, step: int) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        reply = stream.step(epoch, SchedulerOutput(step))   # no StepResponse: only the status
        pytest.fail(f"a stream without the key ran step {step}: tokens {_tokens(reply)}")
    return refused.value


@pytest.mark.parametrize("impostor_key", ["none", "random"])
def test_an_impostor_with_the_token_epoch_and_step_cannot_read_or_supersede(worker,
                                                                            impostor_key):
    stub, key, epoch = worker
    owner = Stream(stub, keyed(TOKEN, key))
    assert len(_tokens(owner.step(epoch, PREFILL))) == 2
    # The impostor knows everything but the key: the token, the epoch (Info) and the next step.
    info = stub.Info(worker_pb2.InfoRequest(), timeout=10, metadata=bearer(TOKEN))
    assert info.epoch == epoch
    guess = secrets.token_bytes(32) if impostor_key == "random" else b""
    error = _refused(Stream(stub, keyed(TOKEN, guess)), info.epoch, 1)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    # A clear status for a grpcurl caller, naming the metadata, and no step number.
    assert "stream key" in error.details() and "deltaserve-stream-key-bin" in error.details()
    assert "expected step" not in error.details()
    # The owner's stream was not superseded and its epoch not failed: step 1 runs as if the
    # impostor had never come, both requests decoding.
    assert len(_tokens(owner.step(epoch, SchedulerOutput(1)))) == 2
    # Neither Info nor Health tells the key.
    health = stub.Health(worker_pb2.HealthRequest(), timeout=10, metadata=bearer(TOKEN))
    assert len(key) == 32
    assert key not in info.SerializeToString() and key not in health.SerializeToString()


def test_the_owners_reconnect_within_the_grace_keeps_every_request(worker, server):
    stub, key, epoch = worker
    owner = Stream(stub, keyed(TOKEN, key))
    _tokens(owner.step(epoch, PREFILL))
    owner.call.cancel()                            # the owner's connection drops
    impostor = Stream(stub, bearer(TOKEN))          # while the stream is orphaned
    assert _refused(impostor, epoch, 1).code() == grpc.StatusCode.PERMISSION_DENIED
    again = Stream(stub, keyed(TOKEN, key))         # the owner reconnects with its key
    assert len(_tokens(again.step(epoch, SchedulerOutput(1)))) == 2
    assert len(server.node_worker.ranks.runner.requests) == 2


@pytest.mark.parametrize("impostor_key", ["none", "random"])
def test_an_impostor_with_the_owners_id_cannot_reset_its_epoch(worker, server, impostor_key):
    """Before, Reset asked only for the owner's id, which Info publishes: a holder of the token
    wiped the owner's cache and failed its next step, as often as it liked."""
    stub, key, epoch = worker
    owner = Stream(stub, keyed(TOKEN, key))
    assert len(_tokens(owner.step(epoch, PREFILL))) == 2
    info = stub.Info(worker_pb2.InfoRequest(), timeout=10, metadata=bearer(TOKEN))
    assert (info.epoch, info.scheduler_id) == (epoch, "owner")
    guess = secrets.token_bytes(32) if impostor_key == "random" else b""
    with pytest.raises(grpc.RpcError) as refused:
        stub.Reset(worker_pb2.ResetRequest(epoch=info.epoch + 1, scheduler_id=info.scheduler_id),
                   timeout=60, metadata=keyed(TOKEN, guess))
    error = refused.value
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
    assert error.details().startswith("Reset failed: Reset refused: it carries ")
    assert "stream key" in error.details() and "deltaserve-stream-key-bin" in error.details()
    # Nothing changed: the epoch, its owner and key, both cached requests; the owner's stream
    # runs its next step with both.
    node = server.node_worker
    assert (node.fence.epoch, node.fence.owner, node.stream_key(epoch)) == (epoch, "owner", key)
    assert len(node.ranks.runner.requests) == 2
    assert len(_tokens(owner.step(epoch, SchedulerOutput(1)))) == 2


def test_the_owners_reset_voids_the_last_key(worker):
    stub, key, epoch = worker
    reply = stub.Reset(worker_pb2.ResetRequest(epoch=epoch + 1, scheduler_id="owner"),
                       timeout=60, metadata=keyed(TOKEN, key))
    assert reply.stream_key not in (b"", key)
    old = _refused(Stream(stub, keyed(TOKEN, key)), epoch + 1, 0)
    assert old.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as again:      # nor does the last key Reset again
        stub.Reset(worker_pb2.ResetRequest(epoch=epoch + 2, scheduler_id="owner"),
                   timeout=60, metadata=keyed(TOKEN, key))
    assert again.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "carries the wrong stream key" in again.value.details()
    assert len(_tokens(Stream(stub, keyed(TOKEN, reply.stream_key)).step(epoch + 1,
                                                                        PREFILL))) == 2


def test_streams_without_the_key_hold_no_worker_thread(worker):
    """The server has 8 pooled threads and a Step handler holds one while its stream is open.
    Before, 8 streams of a token holder that never sent a step held them all and the owner's
    stream never ran; now each is refused when it opens, without waiting for a message."""
    stub, key, epoch = worker
    idle = [stub.Step(iter(queue.SimpleQueue().get, None), timeout=60, metadata=bearer(TOKEN))
            for _ in range(16)]
    for call in idle:
        with pytest.raises(grpc.RpcError) as refused:
            next(call)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    owner = Stream(stub, keyed(TOKEN, key))
    assert len(_tokens(owner.step(epoch, PREFILL))) == 2
