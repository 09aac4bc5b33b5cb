"""Faults with real processes: a worker killed mid-stream and restarted, a scheduler killed and
restarted against a running worker, and a scheduler in a process where torch cannot be imported.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import grpc
import pytest

from tests.support.grpc_harness import (Processes, child_env, collect, free_port, generation_stub,
                                        greedy_request, health_status, pb, wait_for, wait_ready,
                                        worker_info)

PROMPT = [3, 14, 15, 92, 65, 35]
NUM_TOKENS = 8

# Put first on PYTHONPATH: every `import torch` in the process raises ImportError.
NO_TORCH_SITECUSTOMIZE = textwrap.dedent("""
    import sys

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked in this process (torch-free test)")
            return None

    sys.meta_path.insert(0, _NoTorch())
""")


class Cluster:
    """One worker port for the module; the worker on it can be killed and started again."""

    def __init__(self, procs: Processes, model_dir: str):
        self.procs = procs
        self.model_dir = model_dir
        self.worker_port = free_port()
        self.worker = procs.worker(self.worker_port)

    def ensure_worker(self):
        if not self.worker.alive():
            self.worker = self.procs.worker(self.worker_port)
        return self.worker

    def scheduler(self, env: dict | None = None):
        port = free_port()
        # A long grace: the drain test's stream must finish however loaded the machine is (the
        # drain ends as soon as it does; 10 s was too short once on a loaded 2-core machine).
        proc = self.procs.scheduler(self.model_dir, [self.worker_port], port, "--max-model-len",
                                    "2048", "--grace-period", "120", env=env)
        return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    procs = Processes(tmp_path_factory.mktemp("faults"))
    try:
        yield Cluster(procs, tiny_models("qwen3"))
    finally:
        procs.close()


def _greedy(target: str) -> list[int]:
    with grpc.insecure_channel(target) as ch:
        ids, _, _ = collect(generation_stub(ch).Generate(greedy_request(PROMPT, NUM_TOKENS),
                                                         timeout=30))
    return ids


class _OpenStream(threading.Thread):
    """A long Generate stream read on a thread; records how it ended and why."""

    def __init__(self, target: str, i: int):
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(target)
        self.stream = generation_stub(self.channel).Generate(
            greedy_request([3 + i, 4, 5], 2000), timeout=120)
        self.first = threading.Event()
        self.code = None
        self.details = ""

    def run(self):
        try:
            for _ in self.stream:
                self.first.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details()
        finally:
            self.first.set()
            self.channel.close()


def test_worker_killed_mid_stream_fails_streams_then_recovers(cluster):
    sched, target = cluster.scheduler()
    worker = cluster.ensure_worker()
    wait_ready(target, [worker, sched])
    before = _greedy(target)
    streams = [_OpenStream(target, i) for i in range(4)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(30)
    worker.kill()
    for s in streams:
        s.join(15)
        assert s.code == grpc.StatusCode.UNAVAILABLE, s.code
        # At once: the worker's ended Step stream failed them, not the step timeout.
        assert "Step stream ended" in s.details and "no reply" not in s.details, s.details
    wait_for(lambda: health_status(target, "deltaserve.v1.Generation") == "NOT_SERVING", 5,
             "readiness to drop", [sched])
    with pytest.raises(grpc.RpcError) as err:
        _greedy(target)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert health_status(target, "") == "SERVING"

    restarted = cluster.ensure_worker()   # the same port
    wait_ready(target, [restarted, sched], timeout=90)
    assert _greedy(target) == before
    sched.stop()


def test_scheduler_restart_keeps_worker_and_runs_torch_free(cluster, tmp_path):
    worker = cluster.ensure_worker()
    worker_pid = worker.pid
    first, target = cluster.scheduler()
    wait_ready(target, [worker, first])
    before = _greedy(target)
    epoch = worker_info(cluster.worker_port).epoch
    in_flight = _OpenStream(target, 0)
    in_flight.start()
    assert in_flight.first.wait(30)
    first.kill()   # a crash: the worker still holds the old epoch's requests
    in_flight.join(10)

    no_torch = tmp_path / "no_torch"
    no_torch.mkdir()
    (no_torch / "sitecustomize.py").write_text(NO_TORCH_SITECUSTOMIZE)
    env = {"PYTHONPATH": f"{no_torch}:{child_env(None)['PYTHONPATH']}"}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=child_env(env),
                           capture_output=True, text=True, timeout=30)
    assert probe.returncode != 0 and "blocked" in probe.stderr

    second, target2 = cluster.scheduler(env=env)
    wait_ready(target2, [worker, second], timeout=60)
    assert worker.alive() and cluster.worker.pid == worker_pid   # never restarted
    assert worker_info(cluster.worker_port).epoch != epoch
    assert _greedy(target2) == before

    # SIGTERM drains: a stream already open runs to its end, then the process exits cleanly.
    with grpc.insecure_channel(target2) as ch:
        stream = generation_stub(ch).Generate(greedy_request(PROMPT, 150), timeout=60)
        first_msg = next(stream)
        second.popen.terminate()
        ids, _, msgs = collect(stream)
    assert len(first_msg.token_ids) + len(ids) == 150 and msgs[-1].finish_reason == pb.LENGTH
    assert second.stop() == 0
