"""Two live schedulers on one worker: the newer takes it over with a higher epoch, the older's
streams end with a clear status, it goes NOT_SERVING and stops trying (it never takes the worker
back), and the newer serves. Before fencing the two re-initialized the worker in turn and almost
every request of both failed."""
from __future__ import annotations

import threading

import grpc
import pytest

from engine_common.wire.protos import GENERATION_SERVICE, vllm_engine_pb2_grpc
from engine_common.wire.protos import smg_common_pb2 as cpb
from tests.support.grpc_harness import (Processes, collect, free_port, generation_stub,
                                        greedy_request, health_status, pb, server_status,
                                        wait_for, wait_ready, worker_info, write_token)

pytestmark = pytest.mark.slow

TAKEOVER = "took this worker over"


def _long_stream(target: str, out: dict) -> threading.Thread:
    def run() -> None:
        with grpc.insecure_channel(target) as ch:
            try:
                out["result"] = collect(generation_stub(ch).Generate(
                    greedy_request([3, 14, 15], 1500, "old-long"), timeout=300))
            except grpc.RpcError as e:
                out["result"] = e
    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("busy", [True, False], ids=["streaming", "idle"])
def test_the_newer_scheduler_wins_and_the_older_stops(tiny_models, tmp_path, busy):
    procs = Processes(tmp_path)
    token_file = tmp_path / "token"
    token = write_token(token_file)
    model = tiny_models("qwen3")
    try:
        w_port, old_port, new_port = free_port(), free_port(), free_port()
        worker = procs.worker(w_port, "--worker-token-file", str(token_file))
        old = procs.scheduler(model, [w_port], old_port, "--worker-token-file", str(token_file))
        old_target, new_target = f"127.0.0.1:{old_port}", f"127.0.0.1:{new_port}"
        wait_ready(old_target, [worker, old])
        first_owner = worker_info(w_port, token).scheduler_id
        stream: dict = {}
        if busy:
            thread = _long_stream(old_target, stream)
            wait_for(lambda: server_status(old_target).num_running == 1, 30, "the old stream")
        new = procs.scheduler(model, [w_port], new_port, "--worker-token-file", str(token_file))
        wait_ready(new_target, [worker, new])
        taken = worker_info(w_port, token)
        assert taken.scheduler_id != first_owner
        # The older scheduler stops within seconds: NOT_SERVING, its stream ended clearly.
        wait_for(lambda: health_status(old_target, GENERATION_SERVICE) == "NOT_SERVING", 10,
                 "the old scheduler to stop serving", [old])
        if busy:
            thread.join(10)
            error = stream["result"]
            assert isinstance(error, grpc.RpcError), "the old stream was not ended"
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "STALE_EPOCH" in error.details() and taken.scheduler_id in error.details()
        # ... and stays stopped: it never re-inits the worker, whose owner stays the newer one.
        # Three turns of its engine loop (a flush is answered at the end of one, after any
        # attempt to rebuild the core), on each of which an unfenced engine would re-init.
        with grpc.insecure_channel(old_target) as ch:
            for _ in range(3):
                reply = vllm_engine_pb2_grpc.VllmEngineStub(ch).FlushCache(
                    cpb.FlushCacheRequest(), timeout=30)
                assert not reply.success and "another scheduler took" in reply.message, reply
        assert worker_info(w_port, token).scheduler_id == taken.scheduler_id
        assert worker.log_tail(400_000).count(TAKEOVER) == 1
        assert "stops driving the workers" in old.log_tail(400_000)
        with grpc.insecure_channel(old_target) as ch:
            with pytest.raises(grpc.RpcError) as refused:
                collect(generation_stub(ch).Generate(greedy_request([5], 4), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "another scheduler took the workers over" in refused.value.details()
        # The newer one serves.
        with grpc.insecure_channel(new_target) as ch:
            ids, _, msgs = collect(generation_stub(ch).Generate(greedy_request([5, 6, 7], 16),
                                                                timeout=60))
        assert len(ids) == 16 and msgs[-1].finish_reason == pb.LENGTH
        assert health_status(new_target, GENERATION_SERVICE) == "SERVING"
    finally:
        procs.close()
