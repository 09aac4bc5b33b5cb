"""Every epoch starts from a zero KV cache: a new owner cannot read the previous one's keys and
values by naming blocks it never wrote.

The worker kept the KV cache over an Init that kept the model (and over a Reset), so a scheduler
that took the worker over could send a request whose block table names the previous owner's
blocks, with their tokens counted as computed (a "prefix-cache hit"), and attention read the
previous owner's KV: its sampled token was the previous owner's next token. The probe below is
that attack: 8 tokens of zeros counted as computed in blocks 0 and 1, then OWNER_PROMPT's last
token at position 8. On a fresh cache it samples FRESH; after OWNER_PROMPT ran, an unscrubbed
cache makes it sample the owner's next token. A real worker service on loopback (tiny model), with
one in-process rank (whose tensors the test reads too) and with two rank processes (TP=2, gloo:
the probe only)."""
from __future__ import annotations

import grpc
import pytest
import torch

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
OWNER_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32]
BLOCKS = [0, 1, 2]
PROBE = SchedulerOutput(0, new_requests=[new(0, [0] * 8 + OWNER_PROMPT[-1:], BLOCKS, computed=8)])
OWNED = SchedulerOutput(0, new_requests=[new(0, OWNER_PROMPT, BLOCKS)],
                        num_scheduled_tokens={0: len(OWNER_PROMPT)})


class Worker:
    """A worker service on loopback and raw calls to it as scheduler `owner`."""

    def __init__(self, server, model_dir: str, tp: int):
        self.server = server
        self.model_dir = model_dir
        self.layout = worker_pb2.ParallelLayout(tp_size=tp, num_local_ranks=tp, num_nodes=1)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.bound_port}")
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.epoch = 0

    def init(self, owner: str) -> None:
        self.epoch += 1
        config = worker_pb2.WorkerConfig(model_dir=self.model_dir, **LIMITS)
        self.key = self.stub.Init(worker_pb2.InitRequest(
            epoch=self.epoch, scheduler_id=owner, config=config, layout=self.layout),
            timeout=300, metadata=bearer(TOKEN)).stream_key

    def reset(self, owner: str) -> int:
        self.epoch += 1
        reply = self.stub.Reset(worker_pb2.ResetRequest(epoch=self.epoch, scheduler_id=owner),
                                timeout=60, metadata=keyed(TOKEN, self.key))
        self.key = reply.stream_key
        return reply.num_dropped_requests

    def first_token(self, diff: SchedulerOutput) -> int:
        """The token step 0 of the current epoch samples for handle 0."""
        request = worker_pb2.StepRequest(epoch=self.epoch, step=0, payload=enc(diff))
        (reply,) = self.stub.Step(iter([request]), timeout=120,
                                  metadata=keyed(TOKEN, self.key))
        assert not reply.HasField("error"), reply.error
        out = decode_runner_output(reply.payload)
        return int(out.sampled_token_ids[list(out.handles).index(0)])

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)
        self.server.node_worker.close()


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)],
                ids=["tp1", "tp2"])
def worker(request, tiny_models):
    tp = request.param
    server = serve_worker("127.0.0.1:0", WorkerServiceOptions(device="cpu", local_ranks=tp),
                          WorkerAuth(token=TOKEN))
    w = Worker(server, tiny_models("llama"), tp)
    try:
        w.init("first")
        w.fresh = w.first_token(PROBE)     # the probe on a cache nobody wrote
        yield w
    finally:
        w.close()


def _in_process(worker: Worker) -> bool:
    """Whether the rank, and so its tensors, are in this process (TP=1)."""
    return worker.layout.tp_size == 1


def _kv_caches(worker: Worker) -> list[torch.Tensor]:
    return worker.server.node_worker.ranks.runner.kv_caches


def _owner_runs(worker: Worker) -> int:
    """Owner A starts an epoch and prefills OWNER_PROMPT into BLOCKS; its next token."""
    worker.init("scheduler-A")
    token = worker.first_token(OWNED)
    if _in_process(worker):
        written = [c[:, BLOCKS].abs().sum().item() for c in _kv_caches(worker)]
        assert all(w > 0 for w in written), written     # the cache holds A's keys and values
    return token


@pytest.mark.parametrize("new_epoch", ["takeover", "init_with_the_owners_id", "reset"])
def test_a_new_epoch_reads_zeros_where_the_last_owner_wrote(worker, new_epoch):
    owner_next = _owner_runs(worker)
    assert owner_next != worker.fresh    # the probe tells a read of A's KV from a zero cache
    before = [c.data_ptr() for c in _kv_caches(worker)] if _in_process(worker) else None
    if new_epoch == "takeover":
        worker.init("scheduler-B")
    elif new_epoch == "init_with_the_owners_id":     # Info publishes it: not proof of anything
        worker.init("scheduler-A")
    else:
        assert worker.reset("scheduler-A") == 1
    if _in_process(worker):
        caches = _kv_caches(worker)
        assert [c.data_ptr() for c in caches] == before     # the same cache, kept...
        assert all(not c.any() for c in caches)              # ...and all zero
        runner = worker.server.node_worker.ranks.runner
        assert not runner.requests and not runner.batch.token_ids.any()
    assert worker.first_token(PROBE) == worker.fresh
