"""Faults with three steps in flight (async scheduling to a worker that pipelines its steps, on
the simulated device: its token at position p is (7 p + 3) mod the vocabulary), over real
processes: the worker killed mid-stream (every open stream ends UNAVAILABLE at once, and the next
epoch, with the worker restarted, keeps three in flight again and gives the same ids), and a
newer scheduler taking the worker over from one with three steps in flight (its stream ends
UNAVAILABLE naming STALE_EPOCH; the newer one serves whole streams)."""
from __future__ import annotations

import threading

import grpc

from engine_common.model_files.model_dir import ModelInfo
from engine_common.wire.protos import GENERATION_SERVICE
from tests.support.grpc_harness import (Processes, collect, free_port, generation_stub,
                                        greedy_request, health_status, pb, server_status,
                                        wait_for, wait_ready, worker_info, write_token)

DEVICE = ["--simulated-device-ms", "2"]
SCHED = ["--async-scheduling", "--max-model-len", "2048", "--max-num-seqs", "4"]
THREE = "they pipeline their steps (3 in flight)"


def _expected(prompt_len: int, max_tokens: int, vocab: int) -> list[int]:
    return [(7 * p + 3) % vocab for p in range(prompt_len, prompt_len + max_tokens)]


def _greedy(target: str, prompt: list[int], n: int) -> list[int]:
    with grpc.insecure_channel(target) as ch:
        ids, _, msgs = collect(generation_stub(ch).Generate(greedy_request(prompt, n),
                                                            timeout=60))
    assert msgs[-1].finish_reason == pb.LENGTH
    return ids


class _Stream(threading.Thread):
    """A long Generate stream read on a thread: its ids, and the error that ended it."""

    def __init__(self, target: str, i: int):
        super().__init__(daemon=True)
        self.target, self.i = target, i
        self.ids: list[int] = []
        self.first = threading.Event()
        self.error: grpc.RpcError | None = None

    def run(self):
        try:
            with grpc.insecure_channel(self.target) as ch:
                for msg in generation_stub(ch).Generate(
                        greedy_request([3 + self.i, 4, 5], 1500, f"long{self.i}"), timeout=120):
                    self.ids.extend(msg.token_ids)
                    self.first.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.first.set()


def _open_streams(target: str, n: int) -> list[_Stream]:
    streams = [_Stream(target, i) for i in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(60)
    return streams


def test_worker_killed_with_three_in_flight_fails_the_streams_then_recovers(tiny_models,
                                                                            tmp_path):
    model = tiny_models("qwen3")
    vocab = ModelInfo.from_dir(model).vocab_size
    procs = Processes(tmp_path)
    try:
        w_port, s_port = free_port(), free_port()
        target = f"127.0.0.1:{s_port}"
        worker = procs.worker(w_port, *DEVICE)
        sched = procs.scheduler(model, [w_port], s_port, *SCHED)
        wait_ready(target, [worker, sched])
        assert sched.log_tail(400_000).count(THREE) == 1
        streams = _open_streams(target, 4)
        worker.kill()
        for s in streams:
            s.join(15)
            assert not s.is_alive()
            assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE
            assert "Step stream ended" in s.error.details(), s.error.details()
            # What came before the failure is the stream's own, in order.
            assert 0 < len(s.ids) < 1500 and s.ids == _expected(3, len(s.ids), vocab)
        wait_for(lambda: health_status(target, GENERATION_SERVICE) == "NOT_SERVING", 5,
                 "readiness to drop", [sched])
        restarted = procs.worker(w_port, *DEVICE)     # the same port: a new epoch
        wait_ready(target, [restarted, sched], timeout=90)
        assert sched.log_tail(400_000).count(THREE) == 2
        assert _greedy(target, [9, 8, 7, 6], 40) == _expected(4, 40, vocab)
        wait_for(lambda: server_status(target).num_used_kv_blocks == 0, 30, "blocks back")
    finally:
        procs.close()


def test_a_newer_scheduler_takes_over_from_one_with_three_in_flight(tiny_models, tmp_path):
    model = tiny_models("qwen3")
    vocab = ModelInfo.from_dir(model).vocab_size
    procs = Processes(tmp_path)
    token_file = tmp_path / "token"
    token = write_token(token_file)
    auth = ["--worker-token-file", str(token_file)]
    try:
        w_port, old_port, new_port = free_port(), free_port(), free_port()
        old_target, new_target = f"127.0.0.1:{old_port}", f"127.0.0.1:{new_port}"
        worker = procs.worker(w_port, *DEVICE, *auth)
        old = procs.scheduler(model, [w_port], old_port, *SCHED, *auth)
        wait_ready(old_target, [worker, old])
        assert THREE in old.log_tail(400_000)
        (stream,) = _open_streams(old_target, 1)
        new = procs.scheduler(model, [w_port], new_port, *SCHED, *auth)
        wait_ready(new_target, [worker, new])
        assert THREE in new.log_tail(400_000)
        taken = worker_info(w_port, token).scheduler_id
        stream.join(15)
        assert not stream.is_alive()
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "STALE_EPOCH" in stream.error.details() and taken in stream.error.details()
        assert stream.ids == _expected(3, len(stream.ids), vocab)
        wait_for(lambda: health_status(old_target, GENERATION_SERVICE) == "NOT_SERVING", 10,
                 "the old scheduler to stop serving", [old])
        assert _greedy(new_target, [9, 8, 7, 6], 40) == _expected(4, 40, vocab)
        wait_for(lambda: server_status(new_target).num_used_kv_blocks == 0, 30, "blocks back")
    finally:
        procs.close()
