"""`deltaserve serve --model tiny`, the embedded default on the test model: creates the tiny model
once, says its weights are random, prints a ready line, serves, and leaves no worker behind on
Ctrl-C or when killed. (The real default model:
tests/e2e/default_model/test_real_model_serve.py.)"""
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

from tests.support.serve_process import children, gone
from tests.support.grpc_harness import (REPO, SMALL_KV_GIB, child_env, collect, free_port,
                                        generation_stub, greedy_request, wait_for)


def _start_serve(tmp_path: Path, name: str):
    port, worker_port = free_port(), free_port()
    log = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--listen", f"127.0.0.1:{port}",
           "--worker-listen", f"127.0.0.1:{worker_port}", "--device", "cpu",
           "--model", "tiny", "--kv-cache-gib", SMALL_KV_GIB, "--metrics-listen", "127.0.0.1:0",
           "--openai-listen", "off"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=child_env({"XDG_CACHE_HOME": str(tmp_path / "cache")}))
    return proc, f"127.0.0.1:{port}", log


def _wait_ready_line(proc, log: Path) -> str:
    def ready():
        assert proc.poll() is None, log.read_text(errors="replace")
        return "DeltaServe ready on" in log.read_text(errors="replace")
    wait_for(ready, 120, "the ready line")
    return log.read_text(errors="replace")


def test_serve_tiny_model_then_ctrl_c_and_kill_leave_no_worker(tmp_path):
    proc, target, log = _start_serve(tmp_path, "first")
    try:
        text = _wait_ready_line(proc, log)
        assert "weights are RANDOM" in text
        assert f"DeltaServe ready on {target}" in text and "grpcurl -plaintext" in text
        assert (tmp_path / "cache" / "deltaserve" / "tiny-qwen3" / "config.json").is_file()
        with grpc.insecure_channel(target) as ch:
            ids, _, msgs = collect(generation_stub(ch).Generate(greedy_request([5, 6], 5),
                                                                timeout=30))
        assert len(ids) == 5
        workers = children(proc.pid)
        assert len(workers) == 1
        proc.send_signal(signal.SIGINT)   # what Ctrl-C delivers (the worker has its own session)
        assert proc.wait(30) == 0
        assert gone(workers[0])
    finally:
        if proc.poll() is None:
            proc.kill()

    # Killed outright, serve cannot stop its worker itself: the worker gets SIGTERM from the
    # kernel (PR_SET_PDEATHSIG) and exits. The cached model is reused.
    proc, target, log = _start_serve(tmp_path, "second")
    worker = None
    try:
        assert "Writing model" not in _wait_ready_line(proc, log)
        worker = children(proc.pid)[0]
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30  # grace 5 s, then the stop watchdog's 5 s
        while not gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        # its log says whether the SIGTERM reached it ("stopping worker"), /proc whether it is
        # pending, blocked or caught, and in which kernel wait each thread sits
        assert gone(worker), log.read_text(errors="replace")[-4000:] + _signal_state(worker)
    finally:
        if proc.poll() is None:
            proc.kill()
        if worker is not None and not gone(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("flags, why", [
    (["--kv-cache-gib", SMALL_KV_GIB, "--fused-ops"], "fused_ops=True"),
    # issue 23: INTERNAL "Cannot allocate memory" after the epoch and owner had changed
    (["--kv-cache-gib", str(2**32)], "its KV cache 4294967296.00 GiB per rank, more than "
                                     "this machine's"),
])
def test_serve_stops_with_code_2_when_the_worker_refuses_the_settings(tmp_path, flags, why,
                                                                    tiny_cache_home):
    """--fused-ops on a CPU without the Triton interpreter: the worker refuses Init
    (INVALID_ARGUMENT); a KV cache larger than the machine (FAILED_PRECONDITION, no other
    owner): likewise. serve says why and exits 2 at once instead of retrying forever, and
    leaves no worker behind."""
    port, worker_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--listen", f"127.0.0.1:{port}",
           "--worker-listen", f"127.0.0.1:{worker_port}", "--device", "cpu",
           "--model", "tiny", *flags, "--metrics-listen", "127.0.0.1:0",
           "--openai-listen", "off"]
    env = child_env({"XDG_CACHE_HOME": tiny_cache_home(tmp_path / "cache")})
    env.pop("TRITON_INTERPRET", None)
    # Retrying forever would run into this timeout (TimeoutExpired fails the test).
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "the worker refused the settings" in out and why in out, out
    assert out.count("Traceback") == 0, out       # a refusal is one line, not a stack trace
    assert "DeltaServe ready" not in out
    with socket.socket() as s:                     # the worker was stopped with serve
        assert s.connect_ex(("127.0.0.1", worker_port)) != 0


def _signal_state(pid: int) -> str:
    """A live process's state, signal masks and its threads' kernel waits (for a failure)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        lines = [ln for ln in status if ln.split(":")[0] in
                 ("State", "PPid", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")]
        for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
            lines.append(f"thread {task.name}: {(task / 'comm').read_text().strip()} "
                         f"wchan={(task / 'wchan').read_text().strip()}")
    except OSError as e:
        return f"\n/proc/{pid}: {e}"
    return "\n" + "\n".join(lines)
