"""The /metrics endpoints of real worker and scheduler processes, scraped with a real HTTP client
during and after a gRPC run: the counters move exactly with the requests sent (n requests -> n
finished, token counters = the tokens streamed, histogram counts = the requests), the KV gauges
return to zero, GetServerStatus agrees, and the names are docs/metrics.md's list. Then the issue's
bar through `deltaserve serve`: 10 Generate calls of 8 tokens."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.support.grpc_harness import (REPO, SMALL_KV_GIB, Processes, child_env, free_port,
                                        generation_stub, greedy_request, pb, server_status,
                                        wait_for, wait_ready)
from tests.support.metrics_scrape import documented_names, scrape

GPU_GAUGES = {f"deltaserve:worker_gpu_{n}" for n in (
    "utilization_ratio", "memory_used_bytes", "memory_total_bytes", "power_watts",
    "temperature_celsius", "sm_clock_hertz")}


@pytest.fixture(scope="module")
def services(tiny_models, tmp_path_factory):
    """A worker and a scheduler, each with its /metrics on a port of its own."""
    procs = Processes(tmp_path_factory.mktemp("metrics"))
    ports = {name: free_port() for name in ("worker", "api", "worker_metrics", "metrics")}
    model = tiny_models("qwen3")
    try:
        worker = procs.worker(ports["worker"], "--metrics-listen",
                              f"127.0.0.1:{ports['worker_metrics']}")
        sched = procs.scheduler(model, [ports["worker"]], ports["api"],
                                "--metrics-listen", f"127.0.0.1:{ports['metrics']}",
                                "--max-num-seqs", "4")
        wait_ready(f"127.0.0.1:{ports['api']}", [worker, sched])
        yield {**ports, "model": {"model_name": Path(model).name}}
    finally:
        procs.close()


async def _run(target: str, metrics_port: int, n: int):
    """n greedy requests of 3..8 tokens and one long one, all at once. When the long one has
    streamed its first output, scrape (mid-run) and abort it. Returns (tokens streamed per
    request, the mid-run scrape, the long request's finish reason)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_stub(channel)

        async def one(i: int):
            reply = stub.Generate(greedy_request([3 + i, 17, 9 + i], 3 + i % 6, f"m{i}"),
                                  timeout=120)
            return sum([len(m.token_ids) async for m in reply])

        async def long():
            ids, mid, last = 0, None, None
            async for msg in stub.Generate(greedy_request([7, 7, 7], 1000, "long"), timeout=120):
                ids += len(msg.token_ids)
                last = msg
                if mid is None:
                    mid = await asyncio.to_thread(scrape, metrics_port)
                    await stub.Abort(pb.AbortRequest(request_ids=["long"]))
            return ids, mid, last.finish_reason

        *short, (long_ids, mid, reason) = await asyncio.gather(*(one(i) for i in range(n)),
                                                              long())
        return short + [long_ids], mid, reason


def _idle(port: int, model: dict) -> bool:
    s = scrape(port)
    return (s.get("deltaserve:kv_blocks_used", **model) == 0
            and s.get("deltaserve:num_requests_running", **model) == 0
            and s.get("deltaserve:num_requests_waiting", **model) == 0)


def _worker_settled(services, before, worker_before, seen: dict) -> bool:
    worker, after = scrape(services["worker_metrics"]), scrape(services["metrics"])
    rank, MODEL = {"rank": "0", "device": "cpu"}, services["model"]
    assert "deltaserve:worker_requests_cached" in worker.names
    steps = worker.get("deltaserve:worker_steps_total", **rank) - worker_before.get(
        "deltaserve:worker_steps_total", **rank)
    sent = (after.get("deltaserve:step_diff_bytes_count", **MODEL)
            - before.get("deltaserve:step_diff_bytes_count", **MODEL))
    seen.update(requests_cached=worker.get("deltaserve:worker_requests_cached", **rank),
                worker_steps=steps, diffs_sent=sent,
                epochs=after.total("deltaserve:epochs_started_total"),
                step_failures=after.total("deltaserve:step_failures_total"))
    return seen["requests_cached"] == 0 and steps == sent


def test_counters_move_exactly_with_the_requests(services):
    target, n, MODEL = f"127.0.0.1:{services['api']}", 6, services["model"]
    before, worker_before = scrape(services["metrics"]), scrape(services["worker_metrics"])
    streamed, mid, long_reason = asyncio.run(_run(target, services["metrics"], n))
    with grpc.insecure_channel(target) as ch:   # one rejected call
        with pytest.raises(grpc.RpcError) as bad:
            list(generation_stub(ch).Generate(pb.GenerateRequest(token_ids=[]), timeout=30))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Idle, and no new request: the engine still tells the worker which requests finished (a
    # step that computes nothing), so it caches none; the two sides then agree on the steps.
    wait_for(lambda: _idle(services["metrics"], MODEL), 30, "the KV gauges to return to zero")
    seen = {}
    try:
        wait_for(lambda: _worker_settled(services, before, worker_before, seen), 30,
                 "the worker to drop every finished request and to have run every step sent")
    except AssertionError as e:
        raise AssertionError(f"{e}\nlast seen: {seen}") from None
    after = scrape(services["metrics"])

    def delta(name, **labels):
        return after.get(name, **MODEL, **labels) - before.get(name, **MODEL, **labels)

    assert long_reason == pb.ABORT and len(streamed) == n + 1
    assert mid.get("deltaserve:num_requests_running", **MODEL) >= 1           # the long one
    assert mid.get("deltaserve:kv_blocks_used", **MODEL) >= 1
    assert delta("deltaserve:requests_received_total") == n + 2
    assert delta("deltaserve:requests_rejected_total", code="INVALID_ARGUMENT") == 1
    assert delta("deltaserve:request_success_total", finished_reason="length", stop="") == n
    assert delta("deltaserve:request_success_total", finished_reason="abort", stop="") == 1
    assert delta("deltaserve:generation_tokens_total") == sum(streamed)
    assert delta("deltaserve:prompt_tokens_total") == 3 * (n + 1)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_generation_tokens", "request_prompt_tokens"):
        assert delta(f"deltaserve:{histogram}_count") == n + 1, histogram
    assert delta("deltaserve:request_generation_tokens_sum") == sum(streamed)
    assert delta("deltaserve:inter_token_latency_seconds_count") == sum(streamed) - (n + 1)
    # Each request: its 3-token prompt in one step, then one step per further output token.
    assert delta("deltaserve:step_batch_size_sum") == sum(streamed)
    assert delta("deltaserve:iteration_tokens_total_sum") == 3 * (n + 1) + sum(streamed) - (n + 1)
    assert after.get("deltaserve:kv_cache_usage_perc", **MODEL) == 0
    _check_server_status_agrees(target, after, MODEL)
    _check_worker_ran_the_scheduler_steps(services, before, after, worker_before)


def _check_server_status_agrees(target: str, scraped, MODEL: dict) -> None:
    status = server_status(target)
    assert status.num_kv_blocks == scraped.get("deltaserve:kv_blocks_total", **MODEL) > 0
    assert status.num_used_kv_blocks == scraped.get("deltaserve:kv_blocks_used", **MODEL)
    assert status.num_workers_ready == scraped.get("deltaserve:workers_ready", **MODEL) == 1


def _check_worker_ran_the_scheduler_steps(services, before, after, worker_before) -> None:
    """Every diff the scheduler sent is one step on the worker's only rank."""
    worker, MODEL = scrape(services["worker_metrics"]), services["model"]
    rank = {"rank": "0", "device": "cpu"}
    steps = worker.get("deltaserve:worker_steps_total", **rank) - worker_before.get(
        "deltaserve:worker_steps_total", **rank)
    sent = (after.get("deltaserve:step_diff_bytes_count", **MODEL)
            - before.get("deltaserve:step_diff_bytes_count", **MODEL))
    assert steps == sent > 0
    assert worker.get("deltaserve:worker_step_execute_seconds_count", **rank) == worker.get(
        "deltaserve:worker_steps_total", **rank)
    assert worker.get("deltaserve:worker_step_phase_seconds_count", phase="forward", **rank) > 0
    assert worker.get("deltaserve:worker_kv_blocks", **rank) == after.get(
        "deltaserve:kv_blocks_total", **MODEL)
    assert worker.get("deltaserve:worker_process_resident_memory_bytes", **rank) > 0


def test_names_are_the_documented_ones(services):
    scheduler, worker = scrape(services["metrics"]), scrape(services["worker_metrics"])
    ours = {n for n in scheduler.names if n.startswith("deltaserve:")}
    assert ours == documented_names("deltaserve:") - documented_names("deltaserve:worker_")
    # On CPU there are no GPU gauges; everything else docs/metrics.md lists is there.
    assert worker.names - {n for n in worker.names if not n.startswith("deltaserve:")} == (
        documented_names("deltaserve:worker_") - GPU_GAUGES)


@pytest.mark.slow
def test_serve_exposes_both_endpoints_by_flag(tmp_path, tiny_cache_home):
    """The bar: `deltaserve serve --metrics-listen 127.0.0.1:P`, 10 Generate calls of 8 tokens:
    finished 10, generation tokens 80, time-to-first-token count 10, KV usage back to 0; the
    worker's endpoint on P+1 has the step-time histograms."""
    api, worker, metrics = free_port(), free_port(), _two_free_ports()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--listen", f"127.0.0.1:{api}",
           "--worker-listen", f"127.0.0.1:{worker}", "--device", "cpu",
           "--model", "tiny", "--kv-cache-gib", SMALL_KV_GIB,
           "--metrics-listen", f"127.0.0.1:{metrics}", "--openai-listen", "off"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=child_env({"XDG_CACHE_HOME": tiny_cache_home(tmp_path / "cache")}))
    try:
        wait_for(lambda: "DeltaServe ready on" in log.read_text(errors="replace"), 120,
                 "serve's ready line")
        with grpc.insecure_channel(f"127.0.0.1:{api}") as ch:
            stub = generation_stub(ch)
            tokens = [len(m.token_ids) for i in range(10)
                      for m in stub.Generate(greedy_request([5, 6 + i], 8), timeout=60)]
        wait_for(lambda: scrape(metrics).get("deltaserve:kv_blocks_used", model_name="tiny-qwen3")
                 == 0, 30, "KV usage back to 0")
        s, w = scrape(metrics), scrape(metrics + 1)
    finally:
        proc.terminate()
        proc.wait(30)
    model = {"model_name": "tiny-qwen3"}
    assert sum(tokens) == 80
    assert s.get("deltaserve:request_success_total", finished_reason="length", stop="",
                 **model) == 10
    assert s.get("deltaserve:generation_tokens_total", **model) == 80
    assert s.get("deltaserve:time_to_first_token_seconds_count", **model) == 10
    assert s.get("deltaserve:kv_cache_usage_perc", **model) == 0
    rank = {"rank": "0", "device": "cpu"}
    assert w.get("deltaserve:worker_step_execute_seconds_count", **rank) >= 8
    assert w.get("deltaserve:worker_step_phase_seconds_count", phase="forward", **rank) >= 8
    text = log.read_text(errors="replace")
    assert f"scheduler metrics on http://127.0.0.1:{metrics}/metrics" in text
    assert f"worker metrics on http://127.0.0.1:{metrics + 1}/metrics" in text


def _two_free_ports() -> int:
    """A port P with P+1 free too (the worker's default is the next port)."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two adjacent free ports")


@pytest.mark.slow
def test_a_worker_with_two_rank_processes_reports_each_rank(tiny_models, tmp_path):
    """--local-ranks 2: each rank process times its own steps and sends them back on the reply
    ring; the worker's endpoint has one series per rank, and each rank's process figures."""
    procs = Processes(tmp_path)
    w_port, api, w_metrics = free_port(), free_port(), free_port()
    try:
        worker = procs.worker(w_port, "--local-ranks", "2", "--metrics-listen",
                              f"127.0.0.1:{w_metrics}")
        sched = procs.scheduler(tiny_models("llama"), [w_port], api)
        wait_ready(f"127.0.0.1:{api}", [worker, sched], timeout=180)
        with grpc.insecure_channel(f"127.0.0.1:{api}") as ch:
            for i in range(3):
                list(generation_stub(ch).Generate(greedy_request([4, 5 + i], 6), timeout=120))
        # The scheduler may have one more step in flight when the last stream ends, and a
        # scrape can fall between its two ranks' counts: read again until a scrape falls
        # outside a step (bounded; the trailing step ends in milliseconds).
        ranks = [{"rank": str(r), "device": "cpu"} for r in (0, 1)]
        for _ in range(200):
            w = scrape(w_metrics)
            steps = [w.get("deltaserve:worker_steps_total", **r) for r in ranks]
            if steps[0] == steps[1]:
                break
    finally:
        procs.close()
    assert steps[0] == steps[1] >= 6                       # every step ran on both ranks
    for r in ranks:
        assert w.get("deltaserve:worker_step_phase_seconds_count", phase="forward", **r) > 0
        assert w.get("deltaserve:worker_process_resident_memory_bytes", **r) > 0
        assert w.get("deltaserve:worker_kv_blocks", **r) > 0
    assert w.get("deltaserve:worker_process_cpu_seconds_total", **ranks[1]) > 0
