"""The real Shepherd Model Gateway (PyPI `smg`, a dev extra) in front of DeltaServe replicas.

`smg_executable()` finds the `smg` command beside this Python (or on PATH) and checks that its
binary runs, or says why not (`require_smg()` skips the test with that reason). `Replica` is one
worker and its scheduler; `Gateway` starts `smg launch` on loopback ports in front of their
`grpc://` URLs; `http_json` and `SseStream` talk OpenAI HTTP to it. `chat_model_dir` copies a
model directory and writes a ChatML chat template into its tokenizer_config.json (the gateway
applies chat templates itself).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from engine_common.wire.protos import vllm_engine_pb2 as vpb
from engine_common.wire.protos import vllm_engine_pb2_grpc
from tests.support.grpc_harness import (REPO, Processes, Proc, child_env, free_port, wait_for,
                                       wait_ready)

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def smg_executable() -> tuple[str | None, str]:
    """(path, "") when the gateway's binary runs here, else (None, why not)."""
    beside = Path(sys.executable).parent / "smg"
    path = str(beside) if beside.exists() else shutil.which("smg")
    if path is None:
        return None, "the `smg` command is not installed (pip install 'smg==1.13.0', a dev extra)"
    try:
        done = subprocess.run([path, "launch", "--help"], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"`smg launch --help` could not run: {e}"
    if done.returncode != 0:
        return None, f"`smg launch --help` exited {done.returncode}: {done.stderr[-300:]}"
    return path, ""


def require_smg() -> str:
    """The `smg` command, or skip the calling test with the reason it cannot run here."""
    path, why = smg_executable()
    if path is None:
        pytest.skip(why)
    return path


def chat_model_dir(src: str | Path, dst: Path, template: str = CHATML) -> Path:
    """A copy of the model directory whose tokenizer_config.json carries `template`."""
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2))
    return dst


class Gateway:
    """One `smg launch` process in front of `worker_urls`, polled every second for health. It
    runs in `log_dir`, so a relative model path the replicas were given (they run in the
    repository root) is unreadable to it and it fetches the tokenizer with GetTokenizer. No
    shutdown grace: no test drains it, and its default grace held each close for 5 s."""

    def __init__(self, smg: str, worker_urls: list[str], model_dir: str | Path, log_dir: Path,
                 *flags: str):
        self.port, self.metrics_port = free_port(), free_port()
        cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *worker_urls, "--model-path", str(model_dir),
               "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(self.metrics_port), "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--log-level", "info", "--shutdown-grace-period-secs", "0", *flags]
        self.proc = Proc("smg", cmd, log_dir / f"smg-{self.port}.log", child_env(None),
                         cwd=log_dir)

    def workers(self) -> list[dict]:
        try:
            return http_json(self.port, "GET", "/workers", timeout=5)[1].get("workers", [])
        except (OSError, ValueError):
            return []

    def ready(self) -> bool:
        """The gateway's own readiness: healthy workers and a registered tokenizer."""
        try:
            return http_json(self.port, "GET", "/readiness", timeout=5)[0] == 200
        except (OSError, ValueError):
            return False

    def wait_healthy(self, num_workers: int, timeout: float = 120.0, procs=()) -> None:
        def healthy() -> bool:
            workers = self.workers()
            return (len(workers) == num_workers and all(w.get("is_healthy") for w in workers)
                    and self.ready())
        wait_for(healthy, timeout, f"{num_workers} healthy workers behind a ready gateway",
                 [self.proc, *procs])

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus series over the samples carrying `labels` (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as reply:
            text = reply.read().decode()
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and all(w in line for w in wanted))

    def close(self) -> None:
        self.proc.stop(timeout=10)


def http_json(port: int, method: str, path: str, body: dict | None = None,
              timeout: float = 60.0) -> tuple[int, dict]:
    """(status, JSON body) of one HTTP request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


class SseStream:
    """A streaming OpenAI request; `events()` yields each `data:` JSON until [DONE]."""

    def __init__(self, port: int, path: str, body: dict, timeout: float = 60.0):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        self.resp = self.conn.getresponse()

    def events(self):
        while True:
            line = self.resp.fp.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)

    def disconnect(self) -> float:
        """Drop the connection (a client going away); returns the monotonic time of it."""
        self.conn.sock.close()
        self.conn.close()
        return time.monotonic()


class Replica:
    """One worker and its scheduler (the public API and VllmEngine on one port, its Prometheus
    metrics on `metrics_port`)."""

    def __init__(self, procs: Processes, model_dir, *flags: str):
        self.procs = procs
        self.worker_port, self.port, self.metrics_port = free_port(), free_port(), free_port()
        self.worker = procs.worker(self.worker_port)
        # No grace period: the gateway's KV-event stream would hold each stop for its length.
        self.scheduler = procs.scheduler(str(model_dir), [self.worker_port], self.port,
                                         "--metrics-listen", f"127.0.0.1:{self.metrics_port}",
                                         "--grace-period", "0", *flags)
        self.target = f"127.0.0.1:{self.port}"
        self.url = f"grpc://{self.target}"
        wait_ready(self.target, [self.worker, self.scheduler])

    def restart_worker(self) -> None:
        self.worker = self.procs.worker(self.worker_port)

    def last_receive(self) -> float:
        with grpc.insecure_channel(self.target) as ch:
            return vllm_engine_pb2_grpc.VllmEngineStub(ch).GetServerInfo(
                vpb.GetServerInfoRequest(), timeout=5).last_receive_timestamp


@contextlib.contextmanager
def pooling_gateway(model: str, log_dir: Path):
    """A Gateway in front of one `--runner pooling` replica of `model` (smg must run)."""
    smg = require_smg()
    procs = Processes(log_dir)
    gw = None
    try:
        replica = Replica(procs, os.path.relpath(model, REPO), "--runner", "pooling")
        gw = Gateway(smg, [replica.url], os.path.basename(model), log_dir)
        gw.wait_healthy(1, procs=procs.procs)
        yield gw
    finally:
        if gw is not None:
            gw.close()
        procs.close()
