"""Clients that stop reading their Generate streams (session 46: --stream-send-timeout).

A worker and a scheduler as processes (the tiny Qwen3 by default). `--streams` Generate streams
(logprobs 20, ignore_eos, `--max-tokens` each) are opened by clients that never read them,
each on its own channel with a fixed 64 KiB HTTP/2 window (no BDP probing); meanwhile another
client's 64-token stream is timed, and timed again beside as many streams that are read, for
comparison. Then the stalled streams are read: each must end RESOURCE_EXHAUSTED naming the
flag once the timeout passed (or, had it finished first, with its whole output). The
scheduler's resident memory is read from /proc before, while the streams are stalled, and
after they were cut.

    python -m bench.stalled_readers [--model DIR] [--streams 16] [--max-tokens 1000]
                                    [--timeout 5]
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.services import Services
from deltaserve.embedded import tiny_model_dir
from engine_common.wire.protos import generation_pb2 as gpb
from engine_common.wire.protos import generation_pb2_grpc

PROMPT = list(range(40, 60))
NO_BDP = [("grpc.http2.bdp_probe", 0)]


def _request(request_id: str, max_tokens: int, logprobs: int) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(request_id=request_id, token_ids=PROMPT, logprobs=logprobs,
                               stopping=gpb.StoppingCriteria(max_tokens=max_tokens,
                                                             ignore_eos=True))


def _timed_stream(target: str, request_id: str) -> tuple[float, int]:
    """(seconds, tokens) of a 64-token stream read as it comes."""
    with grpc.insecure_channel(target) as ch:
        start = time.perf_counter()
        msgs = list(generation_pb2_grpc.GenerationStub(ch).Generate(
            _request(request_id, 64, 0), timeout=600))
        return time.perf_counter() - start, sum(len(m.token_ids) for m in msgs)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _drain(call) -> tuple[int, str]:
    """(tokens read, how the stream ended)."""
    tokens = 0
    try:
        for msg in call:
            tokens += len(msg.token_ids)
    except grpc.RpcError as e:
        return tokens, f"{e.code().name}: {e.details()[:60]}..."
    return tokens, "OK"


def run(model: str, streams: int, max_tokens: int, timeout_s: float) -> None:
    with tempfile.TemporaryDirectory() as logs, Services(logs) as svc:
        target = svc.start(model, "cpu", ["--stream-send-timeout", str(timeout_s),
                                          "--max-num-seqs", str(streams + 2)])
        pid = svc.procs[-1].popen.pid
        _timed_stream(target, "warm")
        idle, _ = _timed_stream(target, "idle")
        rss_before = _rss_mib(pid)
        # beside `streams` streams that are read: the batch's own cost
        with grpc.insecure_channel(target) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            calls = [stub.Generate(_request(f"read-{i}", max_tokens, 20), timeout=600)
                     for i in range(streams)]
            readers = [threading.Thread(target=_drain, args=(c,)) for c in calls]
            for t in readers:
                t.start()
            beside_read, _ = _timed_stream(target, "beside-read")
            for t in readers:
                t.join()
        # beside `streams` streams nobody reads
        channels = [grpc.insecure_channel(target, options=NO_BDP) for _ in range(streams)]
        stalled = [generation_pb2_grpc.GenerationStub(c).Generate(
            _request(f"stalled-{i}", max_tokens, 20), timeout=600)
            for i, c in enumerate(channels)]
        start = time.perf_counter()
        beside_stalled, tokens = _timed_stream(target, "beside-stalled")
        rss_stalled = _rss_mib(pid)
        time.sleep(timeout_s + 2)           # a benchmark: let the timeout pass
        ends = [_drain(c) for c in stalled]
        waited = time.perf_counter() - start
        rss_after = _rss_mib(pid)
        for c in channels:
            c.close()
    print(f"tiny 64-token stream: idle {idle:.2f} s; beside {streams} streams read "
          f"{beside_read:.2f} s; beside {streams} stalled {beside_stalled:.2f} s "
          f"({tokens} tokens)")
    print(f"scheduler RSS: before {rss_before:.0f} MiB, with stalled streams "
          f"{rss_stalled:.0f} MiB, after {waited:.0f} s {rss_after:.0f} MiB")
    outcomes: dict[str, int] = {}
    for tokens_read, how in ends:
        outcomes[how] = outcomes.get(how, 0) + 1
    for how, n in outcomes.items():
        print(f"{n} stalled streams ended {how}")
    print(f"tokens read by the stalled clients: {[t for t, _ in ends]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: tiny Qwen3)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=5.0, help="--stream-send-timeout")
    args = parser.parse_args()
    run(args.model or str(tiny_model_dir()), args.streams, args.max_tokens, args.timeout)


if __name__ == "__main__":
    main()
