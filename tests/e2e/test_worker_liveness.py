"""A worker that stops answering (SIGSTOP) is detected within the configured step timeout: the
running and the waiting requests end UNAVAILABLE instead of hanging, readiness turns NOT_SERVING,
new requests are refused at once, and service resumes when the worker does (SIGCONT)."""
from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from engine_common.wire.protos import GENERATION_SERVICE
from tests.support.grpc_harness import (Processes, collect, free_port, generation_stub,
                                        greedy_request, health_status, server_status, wait_for,
                                        wait_ready)

pytestmark = pytest.mark.slow

STEP_TIMEOUT_S = 3.0
# How long the test waits for the streams to end (a bound against a hang, not an assertion):
# the step timeout plus twice the slowest recent step and the engine's reaction, on a loaded
# machine. That the step timeout ended them is shown by their message.
DETECTED_WITHIN_S = 40.0


def _streams(target: str, n: int) -> tuple[list, list[threading.Thread], list]:
    results, ended = [None] * n, [None] * n

    def run(i: int) -> None:
        with grpc.insecure_channel(target) as ch:
            try:
                results[i] = collect(generation_stub(ch).Generate(
                    greedy_request([3 + i, 14, 15], 1500, f"live{i}"), timeout=300))
            except grpc.RpcError as e:
                results[i] = e
            ended[i] = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return results, threads, ended


def test_a_stopped_worker_is_detected_and_service_resumes(tiny_models, tmp_path):
    procs = Processes(tmp_path)
    try:
        w_port, s_port = free_port(), free_port()
        worker = procs.worker(w_port)
        sched = procs.scheduler(tiny_models("qwen3"), [w_port], s_port, "--step-timeout",
                                str(STEP_TIMEOUT_S), "--max-num-seqs", "1")
        target = f"127.0.0.1:{s_port}"
        wait_ready(target, [worker, sched])
        results, threads, ended = _streams(target, 3)       # one runs, two wait
        wait_for(lambda: (lambda s: s.num_running == 1 and s.num_waiting == 2)(
            server_status(target)), 60, "one running and two waiting requests", [sched])
        stopped = time.monotonic()
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            for t in threads:
                t.join(DETECTED_WITHIN_S + 30)
            assert all(isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE
                       for r in results), results
            # The step timeout caught it (not the streams' 300 s deadline): its message.
            assert all("no reply to step" in r.details() for r in results), results
            detected = max(ended) - stopped
            wait_for(lambda: health_status(target, GENERATION_SERVICE) == "NOT_SERVING", 10,
                     "readiness NOT_SERVING", [sched])
            with grpc.insecure_channel(target) as ch:
                with pytest.raises(grpc.RpcError) as refused:
                    collect(generation_stub(ch).Generate(greedy_request([5], 4), timeout=60))
                # Refused (UNAVAILABLE), not left to its deadline (DEADLINE_EXCEEDED).
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        wait_ready(target, [worker, sched], timeout=120)
        with grpc.insecure_channel(target) as ch:
            ids, _, _ = collect(generation_stub(ch).Generate(greedy_request([5, 6], 8), timeout=60))
        assert len(ids) == 8
        print(f"detected {detected:.1f} s after SIGSTOP (--step-timeout {STEP_TIMEOUT_S:g})")
    finally:
        procs.close()
