"""The Worker gRPC service and its client, against real worker processes on loopback ports."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine_common.wire.codec import decode_runner_output, encode_scheduler_output
from engine_common.wire.diff import NewRequestData, SchedulerOutput
from engine_common.request.params import SamplingParams, WorkerSamplingParams
from engine_common.wire.protos import WORKER_SERVICE, worker_pb2, worker_pb2_grpc
from kernels.cpu import extension
from scheduler_service.errors import Fenced, WorkerFailure, WorkerRefused
from scheduler_service.workers.worker_client import InitSpec, WorkerClient
from engine_common.security.stream_key import stream_key_metadata
from tests.support.grpc_harness import wait_stopped
from tests.support.init_specs import init_request, init_spec
from tests.support.paths import REPO

PROMPTS = [[3, 14, 15, 92, 65, 35], [2, 71, 82, 81]]
NUM_DECODE_STEPS = 5
KV_BYTES = 1 << 20


class WorkerProcess:
    """`deltaserve worker` on a free loopback port; logs go to files."""

    def __init__(self, log_dir: Path, listen: str = "127.0.0.1:0"):
        self.out_path, self.err_path = log_dir / "worker.out", log_dir / "worker.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deltaserve.cli", "worker", "--listen", listen,
                 "--device", "cpu"],
                cwd=REPO, stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.address = self._wait_listening(timeout_s=120)

    def _wait_listening(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.out_path.read_text().splitlines():
                if "listening on" in line:
                    return line.split("listening on ")[1].split()[0]
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {self.err_path.read_text()[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError("worker did not start listening")

    def num_model_loads(self) -> int:
        return self.err_path.read_text().count("loaded model ")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def model_dir(tiny_models) -> str:
    return tiny_models("qwen3")


@pytest.fixture
def spawn_worker(tmp_path_factory):
    """Start worker processes; every one is killed when the test ends."""
    procs: list[WorkerProcess] = []

    def spawn(listen: str = "127.0.0.1:0") -> WorkerProcess:
        procs.append(WorkerProcess(tmp_path_factory.mktemp("worker"), listen))
        return procs[-1]

    yield spawn
    for p in procs:
        p.kill()


@pytest.fixture(scope="module")
def shared_worker(tmp_path_factory):
    proc = WorkerProcess(tmp_path_factory.mktemp("shared-worker"))
    yield proc
    proc.kill()


@pytest.fixture
def client(shared_worker):
    c = WorkerClient([shared_worker.address])
    yield c
    c.close()


def _spec(model_dir: str, **overrides) -> InitSpec:
    args = dict(model_dir=model_dir, dtype="float32", block_size=4, kv_cache_bytes=KV_BYTES,
                max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    return init_spec(**{**args, **overrides})


def _diffs(block_size: int = 4) -> list[SchedulerOutput]:
    """Step 0 prefills PROMPTS (handles 0, 1); the next steps decode one token each."""
    greedy = WorkerSamplingParams(SamplingParams(), seed=0)
    new, next_block = [], 0
    for handle, prompt in enumerate(PROMPTS):
        num_blocks = -(-(len(prompt) + NUM_DECODE_STEPS + 1) // block_size)
        new.append(NewRequestData(handle, prompt, greedy,
                                  list(range(next_block, next_block + num_blocks)), 0))
        next_block += num_blocks
    first = SchedulerOutput(step=0, new_requests=new,
                            num_scheduled_tokens={h: len(p) for h, p in enumerate(PROMPTS)})
    return [first] + [SchedulerOutput(step=s) for s in range(1, NUM_DECODE_STEPS + 1)]


def _tokens(run_step) -> dict[int, list[int]]:
    """Feed _diffs() through `run_step(bytes) -> bytes`; collect the sampled ids per handle."""
    tokens: dict[int, list[int]] = {}
    for diff in _diffs():
        out = decode_runner_output(run_step(encode_scheduler_output(diff)))
        assert out.step == diff.step
        for handle, tok in zip(out.handles, out.sampled_token_ids):
            tokens.setdefault(handle, []).append(tok)
    return tokens


def _in_process_tokens(model_dir: str) -> dict[int, list[int]]:
    from worker_service.config import RunnerConfig
    from worker_service.runner.model_runner import ModelRunner
    from engine_common.wire.codec import encode_runner_output

    runner = ModelRunner(RunnerConfig(model_dir=model_dir, dtype="float32", block_size=4,
                                      max_model_len=64, max_num_seqs=4,
                                      max_num_batched_tokens=64, kv_cache_bytes=KV_BYTES))
    runner.init_kv_cache(runner.determine_num_blocks())
    return _tokens(lambda payload: encode_runner_output(runner.execute(payload)))


def _stub(address: str) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))


def _raw_step(address: str, requests: list[worker_pb2.StepRequest], key: bytes):
    """Send `requests` on a fresh Step stream with the epoch's `key`: (responses received, final
    RpcError or None)."""
    responses = []
    try:
        for r in _stub(address).Step(iter(requests), timeout=30,
                                     metadata=stream_key_metadata(key)):
            responses.append(r)
    except grpc.RpcError as e:
        return responses, e
    return responses, None


# -- tests --------------------------------------------------------------------------------------

def test_init_and_steps_match_in_process_runner(client, model_dir):
    result = client.init(_spec(model_dir))
    assert result.num_kv_blocks > 0 and result.kv_block_bytes > 0
    assert result.num_kv_blocks == KV_BYTES // result.kv_block_bytes
    assert result.sliding_window == 0           # the tiny Qwen3 has no window
    (dev,) = result.devices
    assert (dev.kind, dev.node_rank, dev.global_rank) == ("cpu", 0, 0)
    assert dev.total_memory_bytes >= dev.free_memory_bytes > 0
    remote = _tokens(client.execute)
    assert [len(remote[h]) for h in (0, 1)] == [NUM_DECODE_STEPS + 1] * 2
    assert remote == _in_process_tokens(model_dir)


def test_step_gap_wrong_epoch_and_bad_payload(client, shared_worker, model_dir):
    epoch = client.init(_spec(model_dir)).epoch + 1
    client.close()
    # The test drives the worker itself: its own Init (the same settings: the model stays)
    # tells it the epoch's stream key.
    key = _stub(shared_worker.address).Init(
        init_request(_spec(model_dir), epoch, client.scheduler_id)).stream_key
    step0 = encode_scheduler_output(_diffs()[0])
    step1 = encode_scheduler_output(_diffs()[1])
    cases = [  # (requests, StepError code, stream status)
        ([worker_pb2.StepRequest(epoch=epoch + 1, step=0, payload=step0)],
         worker_pb2.StepError.EPOCH_MISMATCH, grpc.StatusCode.FAILED_PRECONDITION),
        ([worker_pb2.StepRequest(epoch=epoch - 1, step=0, payload=step0)],
         worker_pb2.StepError.STALE_EPOCH, grpc.StatusCode.FAILED_PRECONDITION),
        ([worker_pb2.StepRequest(epoch=epoch, step=1, payload=step0)],
         worker_pb2.StepError.STEP_GAP, grpc.StatusCode.FAILED_PRECONDITION),
    ]
    for requests, code, status in cases:
        responses, err = _raw_step(shared_worker.address, requests, key)
        assert responses[-1].error.code == code and err.code() == status, err
    # A refused stream never became the active one: the epoch is intact. A gap on the active
    # stream fails the epoch: even the next step is refused now, until Reset.
    responses, err = _raw_step(shared_worker.address, [
        worker_pb2.StepRequest(epoch=epoch, step=0, payload=step0),
        worker_pb2.StepRequest(epoch=epoch, step=2, payload=step1)], key)
    assert not responses[0].HasField("error")
    assert responses[1].error.code == worker_pb2.StepError.STEP_GAP
    responses, err = _raw_step(shared_worker.address,
                               [worker_pb2.StepRequest(epoch=epoch, step=1, payload=step1)], key)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "Reset" in err.details()

    # Only the owner resets, to a higher epoch, presenting the epoch's stream key.
    for scheduler_id, new_epoch in (("someone-else", epoch + 1), (client.scheduler_id, epoch)):
        with pytest.raises(grpc.RpcError) as refused:
            _stub(shared_worker.address).Reset(
                worker_pb2.ResetRequest(epoch=new_epoch, scheduler_id=scheduler_id),
                metadata=stream_key_metadata(key))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as refused:     # the owner's id, no key
        _stub(shared_worker.address).Reset(
            worker_pb2.ResetRequest(epoch=epoch + 1, scheduler_id=client.scheduler_id))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    key = _stub(shared_worker.address).Reset(
        worker_pb2.ResetRequest(epoch=epoch + 1, scheduler_id=client.scheduler_id),
        metadata=stream_key_metadata(key)).stream_key
    responses, err = _raw_step(shared_worker.address, [
        worker_pb2.StepRequest(epoch=epoch + 1, step=0, payload=step0),
        worker_pb2.StepRequest(epoch=epoch + 1, step=1, payload=b"\xc1 not msgpack")], key)
    assert not responses[0].HasField("error") and responses[0].payload
    assert responses[1].error.code == worker_pb2.StepError.BAD_PAYLOAD
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_raises_worker_failure_on_step_error(client, shared_worker, model_dir):
    client.init(_spec(model_dir))
    with pytest.raises(WorkerFailure, match=rf"{shared_worker.address}.*BAD_PAYLOAD"):
        client.execute(b"\xc1 garbage")
    with pytest.raises(WorkerFailure, match="unusable"):
        client.execute(encode_scheduler_output(_diffs()[0]))
    client.init(_spec(model_dir))  # a new epoch makes it usable again
    assert decode_runner_output(client.execute(encode_scheduler_output(_diffs()[0]))).handles


def test_reset_drops_requests(client, model_dir):
    client.init(_spec(model_dir))
    client.execute(encode_scheduler_output(_diffs()[0]))
    assert client.reset() == len(PROMPTS)
    # Handle 0 is gone: scheduling it is a protocol error...
    with pytest.raises(WorkerFailure, match="BAD_PAYLOAD.*handle 0"):
        client.execute(encode_scheduler_output(SchedulerOutput(step=0,
                                                               num_scheduled_tokens={0: 1})))
    # ...and after another reset the same requests run from scratch, with the same tokens.
    assert client.reset() == 0
    assert _tokens(client.execute) == _in_process_tokens(model_dir)


def test_reinit_keeps_model_and_starts_new_epoch(client, shared_worker, model_dir):
    first = client.init(_spec(model_dir))
    loads = shared_worker.num_model_loads()
    client.execute(encode_scheduler_output(_diffs()[0]))
    second = client.init(_spec(model_dir))
    assert second.epoch != first.epoch and second.num_kv_blocks == first.num_kv_blocks
    assert shared_worker.num_model_loads() == loads
    info = _stub(shared_worker.address).Info(worker_pb2.InfoRequest())
    assert info.model_loaded and info.epoch == second.epoch
    # The old requests are gone and steps restart at 0.
    assert _tokens(client.execute) == _in_process_tokens(model_dir)
    # A different KV budget keeps the weights but re-sizes the cache.
    third = client.init(_spec(model_dir, kv_cache_bytes=2 * KV_BYTES))
    assert third.num_kv_blocks == 2 * first.num_kv_blocks
    assert shared_worker.num_model_loads() == loads
    # A different batch size reloads.
    client.init(_spec(model_dir, max_num_seqs=8))
    assert shared_worker.num_model_loads() == loads + 1


def test_second_client_supersedes_first(shared_worker, model_dir):
    """A restarted scheduler (new client, a higher epoch) takes over; the old one is fenced."""
    old, new = WorkerClient([shared_worker.address]), WorkerClient([shared_worker.address])
    try:
        old.init(_spec(model_dir))
        new.init(_spec(model_dir))
        with pytest.raises(Fenced, match=f"STALE_EPOCH.*scheduler {new.scheduler_id}"):
            old.execute(encode_scheduler_output(_diffs()[0]))
        with pytest.raises(Fenced, match=f"driven by scheduler {new.scheduler_id}"):
            old.init(_spec(model_dir))
        assert _tokens(new.execute) == _in_process_tokens(model_dir)
    finally:
        old.close()
        new.close()


def test_init_errors_are_worker_failures(client, tmp_path):
    with pytest.raises(WorkerRefused, match="INVALID_ARGUMENT.*does not exist"):
        client.init(_spec(str(tmp_path / "missing")))
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    unreachable = WorkerClient([f"127.0.0.1:{port}"], connect_timeout_s=1.0)
    # Ended by the 1 s connect timeout it names, not by waiting for a worker to appear.
    with pytest.raises(WorkerFailure, match=f"127.0.0.1:{port}: not reachable within 1s"):
        unreachable.init(_spec("/nowhere"))
    unreachable.close()


def test_health_info_and_worker_faults(spawn_worker, model_dir):
    worker = spawn_worker()
    stub = _stub(worker.address)
    health = stub.Health(worker_pb2.HealthRequest())
    assert not health.ready and "not initialized" in health.reason
    info = stub.Info(worker_pb2.InfoRequest())
    assert not info.model_loaded and info.device_kind == "cpu" and info.num_kv_blocks == 0
    assert _grpc_health(worker.address, "") == "SERVING"
    assert _grpc_health(worker.address, WORKER_SERVICE) == "NOT_SERVING"

    client = WorkerClient([worker.address], step_timeout_s=2.0)
    try:
        result = client.init(_spec(model_dir))
        assert stub.Health(worker_pb2.HealthRequest()).ready
        assert _grpc_health(worker.address, WORKER_SERVICE) == "SERVING"
        info = stub.Info(worker_pb2.InfoRequest())
        # the default CPU path: the compiled paged kernel when the library is built (it is
        # after make install), else the torch reference
        backend = "cpu" if extension.load() else "torch"
        assert (info.model_dir, info.dtype, info.attention_backend) == (model_dir, "float32",
                                                                        backend)
        assert info.epoch == result.epoch and info.num_kv_blocks == result.num_kv_blocks
        assert info.layout.tp_size == 1 and info.devices[0].total_memory_bytes > 0
        client.execute(encode_scheduler_output(_diffs()[0]))

        # A stuck worker (stopped, connection open) fails the step at the step timeout.
        worker.proc.send_signal(signal.SIGSTOP)
        wait_stopped(worker.proc.pid)
        try:   # the 2 s step timeout, then an unanswered Health, end the wait
            with pytest.raises(WorkerFailure, match=rf"{worker.address}.*no reply to step 1"):
                client.execute(encode_scheduler_output(SchedulerOutput(step=1)))
        finally:
            worker.proc.send_signal(signal.SIGCONT)
        client.init(_spec(model_dir))
        client.execute(encode_scheduler_output(_diffs()[0]))

        worker.kill()
        with pytest.raises(WorkerFailure, match=rf"{worker.address}.*UNAVAILABLE") as killed:
            client.execute(encode_scheduler_output(SchedulerOutput(step=1)))
        # The ended stream failed the step at once, not the step timeout.
        assert "no reply" not in str(killed.value), killed.value
        (h,) = client.health()
        assert not h.ready and "unreachable" in h.reason

        # A worker started again on the same address is found by the next init.
        spawn_worker(worker.address)
        client.init(_spec(model_dir))
        assert decode_runner_output(client.execute(encode_scheduler_output(_diffs()[0]))).handles
    finally:
        client.close()


def _grpc_health(address: str, service: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


TORCH_FREE_CLIENT = """
import faulthandler
import sys

faulthandler.dump_traceback_later(100, exit=True)   # a hang shows where, before the timeout

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, NoTorch())
from engine_common.wire.codec import decode_runner_output, encode_scheduler_output
from engine_common.wire.diff import NewRequestData, SchedulerOutput
from engine_common.request.params import SamplingParams, WorkerSamplingParams
from engine_common.configuration.config import WorkerConfig
from scheduler_service.workers.worker_client import InitSpec, WorkerClient

address, model_dir = sys.argv[1:3]
client = WorkerClient([address], step_timeout_s=60, init_timeout_s=60)
client.init(InitSpec(WorkerConfig(model_dir=model_dir, kv_cache_bytes=1 << 20, block_size=4,
                                  max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)))
diff = SchedulerOutput(step=0, num_scheduled_tokens={0: 3}, new_requests=[NewRequestData(
    0, [5, 6, 7], WorkerSamplingParams(SamplingParams(), seed=0), [0], 0)])
out = decode_runner_output(client.execute(encode_scheduler_output(diff)))
client.close()
assert out.handles == [0] and "torch" not in sys.modules
print("torch-free client OK")
"""


def test_client_runs_without_torch(shared_worker, model_dir):
    done = subprocess.run([sys.executable, "-c", TORCH_FREE_CLIENT, shared_worker.address,
                           model_dir], cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, (done.stderr[-3000:] + "\nworker log:\n"
                                  + shared_worker.err_path.read_text()[-2000:])
    assert "torch-free client OK" in done.stdout


def test_fused_ops_travel_in_init_and_reload_the_model(client, shared_worker, model_dir):
    """fused_ops reaches the worker's model (the load key changes: one reload), and the fused
    kernels (Triton, interpreted on CPU) give the in-process runner's greedy tokens."""
    client.init(_spec(model_dir))
    loads = shared_worker.num_model_loads()
    client.init(_spec(model_dir, fused_ops=True))
    assert shared_worker.num_model_loads() == loads + 1
    assert _tokens(client.execute) == _in_process_tokens(model_dir)
    client.init(_spec(model_dir))
    assert shared_worker.num_model_loads() == loads + 2
