"""The gRPC-overhead benchmark end to end on CPU: the tiny preset through the in-process engine
and through real worker and scheduler processes, a handful of short sequences."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import grpc_overhead
from bench.services import Services
from bench.workload import make_workload
from tests.support.paths import REPO

ARGS = ["--preset", "tiny", "--device", "cpu", "--num-seqs", "4", "--min-len", "4",
        "--max-len", "12", "--cpu-threads", "1", "--kv-cache-gib", "0.01"]
NUMBER = r"([\d.e+-]+)"


def _figure(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in output:\n{text}"
    return float(match.group(1))


def test_grpc_overhead_prints_positive_figures_identical_tokens_and_appends_block(
        tmp_path, capsys, bench_presets):
    results = tmp_path / "results.md"
    argv = ARGS + ["--cache-dir", str(bench_presets), "--results-file", str(results),
                   "--async-scheduling"]
    assert grpc_overhead.main(argv) == 0
    out = capsys.readouterr().out
    asked = make_workload(4, 4, 12, _vocab_size(bench_presets), 0).num_output_tokens
    for path in ("in-process", "gRPC"):
        assert _figure(rf"^{path}: (\d+) output tokens", _line(path, out)) == asked
        assert _figure(rf"tokens in {NUMBER} s", _line(path, out)) > 0
        assert _figure(rf"= {NUMBER} tok/s", _line(path, out)) > 0
        assert _figure(rf"mean time to first token {NUMBER} ms", _line(path, out)) > 0
    assert _figure(r"over (\d+) streams", out) == 4
    assert _figure(rf"gRPC / in-process throughput: {NUMBER}x", out) > 0
    assert "greedy token ids identical: yes" in out
    assert _figure(r"^gRPC, async scheduling: (\d+) output tokens",
                   _line("gRPC, async scheduling", out)) == asked
    assert _figure(rf"gRPC async / one step at a time: {NUMBER}x", out) > 0
    assert "async greedy token ids identical: yes" in out
    text = results.read_text()
    assert re.search(r"^## .* · gRPC overhead · tiny · cpu \(.+\)$", text, re.M)
    assert "- command: `python -m bench.grpc_overhead --preset tiny" in text
    assert "- gRPC / in-process throughput: " in text
    assert "- greedy token ids identical: yes" in text


def test_services_close_stops_both_processes(tmp_path, bench_presets):
    from bench.presets import preset_dir

    model_dir = preset_dir("tiny", bench_presets)
    with Services(tmp_path / "logs") as services:
        target = services.start(str(model_dir), "cpu", ["--kv-cache-gib", "0.004"])
        assert re.fullmatch(r"127\.0\.0\.1:\d+", target)
        popens = [p.popen for p in services.procs]
        assert [p.name for p in services.procs] == ["worker", "scheduler"]
        assert all(p.poll() is None for p in popens)
        assert all(os.getpgid(p.pid) == p.pid for p in popens)     # each its own session
    assert all(p.poll() is not None for p in popens)


def test_services_in_this_group_count_in_its_cpu_seconds(tmp_path, bench_presets):
    """own_session=False (the peer harness's gRPC engine): the worker and the scheduler are in
    this process group, so group_cpu_seconds() includes the CPU they spent loading the model."""
    from bench.peers.protocol import group_cpu_seconds, process_cpu_seconds
    from bench.presets import preset_dir

    model_dir = preset_dir("tiny", bench_presets)
    mine = sum(os.times()[:2])
    with Services(tmp_path / "logs", own_session=False) as services:
        services.start(str(model_dir), "cpu", ["--kv-cache-gib", "0.004"])
        popens = [p.popen for p in services.procs]
        assert all(os.getpgid(p.pid) == os.getpgrp() for p in popens)
        theirs = sum(process_cpu_seconds(p.pid) for p in popens)
        assert theirs > 0
        assert group_cpu_seconds() >= mine + theirs - 0.05
    assert all(p.poll() is not None for p in popens)


def test_sigterm_stops_the_services_it_started(tmp_path, bench_presets):
    """SIGTERM once the worker and the scheduler run: the bench exits and leaves neither."""
    cmd = [sys.executable, "-m", "bench.grpc_overhead", *ARGS, "--num-seqs", "64",
           "--max-len", "64", "--cache-dir", str(bench_presets),
           "--results-file", str(tmp_path / "results.md")]
    bench = subprocess.Popen(cmd, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        children = _wait_for_children(bench, 2, timeout_s=60)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == 128 + signal.SIGTERM
    finally:
        if bench.poll() is None:
            bench.kill()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)]


def _wait_for_children(proc: subprocess.Popen, count: int, timeout_s: float) -> list[int]:
    """The pids of `proc`'s children once it has `count` of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        children = _children(proc.pid)
        if len(children) >= count:
            return children
        time.sleep(0.05)
    tail = proc.stderr.read()[-2000:] if proc.poll() is not None else b"(still running)"
    raise AssertionError(f"not {count} services running; exit {proc.poll()}: {tail!r}")


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:   # the field after the state is the parent's pid
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _line(prefix: str, out: str) -> str:
    return next((ln for ln in out.splitlines() if ln.startswith(prefix + ":")), "")


def _vocab_size(presets: Path) -> int:
    import json

    return json.loads((presets / "tiny" / "config.json").read_text())["vocab_size"]
