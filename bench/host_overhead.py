"""The host's work per decode step, measured on any CPU: does it hide behind the device's?

    python -m bench.host_overhead                         # make bench-host
    python -m bench.host_overhead --device-ms 5.8 --grpc --baseline-tree ../old-checkout
    python -m bench.host_overhead --grpc-only --rounds 5 --baseline-tree ../old-checkout

The model is tiny (1 layer, hidden 64, the 512-id test tokenizer), so its compute is negligible;
every request decodes --output-len tokens (greedy, ignore_eos) with one torch thread. Lanes:

  simulated   in-process engine, async scheduling, forward pass and sampler replaced by a
              simulated device that takes --device-ms per step (runner/simulated_device.py;
              the H100 floor of nano-vllm's workload is 5.8 ms). The achieved step time over
              the device time says whether the host keeps the device busy (1.00 = it does).
  gRPC        the same over separate `deltaserve worker` (simulated device) and
              `deltaserve scheduler` processes on loopback (--grpc): per-request decode time
              per token from the client's streams, and the CPU time each process (the client
              is this one) spent per decode step; with --baseline-tree the same services run
              from the other checkout too (the client stays this tree's), alternating.
  host        no simulated device: the real (negligible) model, one step in flight, 256
              requests: the host work per decode step (the step less the forward pass and
              sampler); with --baseline-tree the same run on another checkout, alternating
              rounds (before/after).

Each lane runs --rounds times in fresh processes (alternating trees); min / median / max of the
steady-state medians. Prints a block and, with --results-file, appends it there.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import child_rounds
from bench.child_rounds import REPO, spread, tiny_model_dir
from bench.isa import describe_cpu
from bench.report import git_commit, print_and_append

CHILD = Path(__file__).resolve().parent / "host_overhead_child.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.host_overhead",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device-ms", type=float, default=5.8,
                   help="simulated device time per step (default: 5.8)")
    p.add_argument("--num-seqs", default="64,128,256",
                   help="running requests of the simulated lane, comma-separated "
                        "(default: 64,128,256)")
    p.add_argument("--output-len", type=int, default=256, help="tokens per request (256)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each lane (default: 3)")
    p.add_argument("--grpc", action="store_true",
                   help="also the gRPC lane (128 requests, separate processes)")
    p.add_argument("--grpc-only", action="store_true",
                   help="only the gRPC lane (with --baseline-tree: alternating with it)")
    p.add_argument("--baseline-tree", default=None,
                   help="another checkout: its host time per step, alternating with this one")
    p.add_argument("--results-file", default=None, help="append the block here")
    return p


def run_child(tree: Path, model: str, num_seqs: int, output_len: int,
              device_ms: float | None, async_scheduling: bool) -> dict:
    return child_rounds.run_child(CHILD, tree, [
        model, str(num_seqs), str(output_len), "none" if device_ms is None else repr(device_ms),
        "1" if async_scheduling else "0"])


def simulated_lane(args, model: str) -> list[str]:
    lines = [f"simulated device {args.device_ms} ms/step, in-process, async scheduling "
             f"(achieved step ms and its ratio to the device time, min / median / max):"]
    for n in [int(x) for x in args.num_seqs.split(",")]:
        runs = [run_child(REPO, model, n, args.output_len, args.device_ms, True)
                for _ in range(args.rounds)]
        steps = [r["phases_ms"]["step"][1] for r in runs]
        lines.append(f"  {n:4d} requests: step {spread(steps)} ms, ratio "
                     f"{spread([s / args.device_ms for s in steps])}")
        lines += phase_lines(runs, "    ")
    return lines


def phase_lines(runs: list[dict], indent: str) -> list[str]:
    """Each phase's median over the steady state, spread over the rounds."""
    names = runs[0]["phases_ms"]
    return [f"{indent}{name:28s} "
            f"{spread([r['phases_ms'][name][1] for r in runs if name in r['phases_ms']])} ms"
            for name in names if name != "step"]


def alternating_rounds(args, run_round) -> dict[str, list[dict]]:
    """child_rounds.alternating_rounds over --rounds and --baseline-tree (at most one)."""
    baselines = [args.baseline_tree] if args.baseline_tree else []
    return child_rounds.alternating_rounds(args.rounds, baselines, run_round)


def host_lane(args, model: str) -> list[str]:
    results = alternating_rounds(
        args, lambda tree: run_child(tree, model, 256, args.output_len, None, False))
    lines = ["host work per decode step (the step less the runner's forward and sampling), "
             "real 1-layer model, 256 requests, one step in flight (ms, min / median / max of "
             "the rounds' steady-state medians):"]
    medians = {}
    for name, runs in results.items():
        host = [r["phases_ms"]["host work"][1] for r in runs]
        steps = [r["phases_ms"]["step"][1] for r in runs]
        medians[name] = statistics.median(host)
        lines.append(f"  {name}: host work {spread(host)} ms = "
                     f"{medians[name] / 256 * 1e3:.1f} us per request per step (whole step "
                     f"{spread(steps)} ms)")
        lines += phase_lines(runs, "    ")
    if len(medians) == 2:
        (a, ours), (b, base) = medians.items()
        lines.append(f"  this tree / baseline: {ours / base:.2f}")
    return lines


def grpc_lane(args, model: str) -> list[str]:
    runs = alternating_rounds(args, lambda tree: grpc_round(tree, model, args))
    lines = [f"gRPC, separate scheduler and worker processes, 128 requests, simulated device "
             f"{args.device_ms} ms: decode ms per token / device ms (the rounds' median "
             f"requests), CPU ms per decode step of each process, and the scheduler's CPU per "
             f"message streamed (a slow consumer's steps merge into one), min / median / max:"]
    medians = {}
    for name, rounds in runs.items():
        ratios = [r["ratio"] for r in rounds]
        medians[name] = statistics.median(ratios)
        cpu = ", ".join(f"{proc} {spread([r['cpu_ms'][proc] for r in rounds])}"
                        for proc in rounds[0]["cpu_ms"])
        lines.append(f"  {name}: ratio {spread(ratios)}; CPU ms per step: {cpu}; scheduler "
                     f"CPU us per message "
                     f"{spread([r['scheduler_us_per_message'] for r in rounds])} (messages "
                     f"per step {spread([r['messages_per_step'] for r in rounds])})")
    if len(medians) == 2:
        (_, ours), (_, base) = medians.items()
        lines.append(f"  this tree / baseline (median ratios): {ours / base:.2f}")
    return lines


def grpc_round(tree: Path, model: str, args) -> dict:
    """One round on fresh `tree` services: the ratio, and the CPU time each process spent per
    decode step while the client streamed."""
    from bench.services import Services

    with tempfile.TemporaryDirectory(prefix="deltaserve-host-") as logs, \
            Services(logs, {"OMP_NUM_THREADS": "1"}, repo_root=tree) as services:
        target = services.start(
            model, "cpu", ["--max-num-seqs", "128", "--max-model-len", "1024",
                           "--kv-cache-gib", "0.05", "--async-scheduling",
                           "--max-waiting", "1024"],
            worker_flags=("--simulated-device-ms", repr(args.device_ms)))
        procs = {proc.name: proc.popen.pid for proc in services.procs}
        before = {name: process_cpu_seconds(pid) for name, pid in procs.items()}
        client_before = _own_cpu_s()
        streams = asyncio.run(_stream_all(target, 128, args.output_len))
        spent = {name: process_cpu_seconds(pid) - before[name] for name, pid in procs.items()}
        spent["client"] = _own_cpu_s() - client_before
    num_messages = sum(n for _, n in streams)
    return {"ratio": statistics.median(ms for ms, _ in streams) / args.device_ms,
            "cpu_ms": {name: s / args.output_len * 1e3 for name, s in spent.items()},
            "scheduler_us_per_message": spent["scheduler"] / num_messages * 1e6,
            "messages_per_step": num_messages / args.output_len}


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc). bench.peers.protocol has one
    for its harness; bench/peers imports from bench/, so importing it here would be a cycle."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


async def _stream_all(target: str, num_seqs: int, output_len: int) -> list[tuple[float, int]]:
    """Per request: (last token time - first token time) / (tokens - 1) in ms, and how many
    messages carried its tokens (fewer than tokens when the server merged steps for a stream
    that fell behind)."""
    import grpc

    from engine_common.wire.protos import generation_pb2 as pb, generation_pb2_grpc

    async def one(stub, i: int) -> tuple[float, int]:
        request = pb.GenerateRequest(
            request_id=f"host-{i}", token_ids=[3 + (i * 7 + j) % 400 for j in range(32)],
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=output_len, ignore_eos=True))
        first = last = None
        count = messages = 0
        async for msg in stub.Generate(request, timeout=600):
            if msg.token_ids:
                last = time.perf_counter()
                first = first or last
                count += len(msg.token_ids)
                messages += 1
        return (last - first) / max(1, count - 1) * 1e3, messages

    async with grpc.aio.insecure_channel(target) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = generation_pb2_grpc.GenerationStub(channel)
        return list(await asyncio.gather(*(one(stub, i) for i in range(num_seqs))))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = tiny_model_dir("host-overhead")
    lines = [f"## host overhead, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"commit {git_commit()}", "",
             f"{describe_cpu()}; model: 1 layer, hidden 64, 512-id tokenizer; "
             f"{args.output_len} tokens per request, greedy, 1 torch thread, {args.rounds} "
             f"rounds", ""]
    if not args.grpc_only:
        lines += simulated_lane(args, model)
    if args.grpc or args.grpc_only:
        lines += grpc_lane(args, model)
    if not args.grpc_only:
        lines += host_lane(args, model)
    return print_and_append(lines, "bench.host_overhead", argv, args.results_file)


if __name__ == "__main__":
    sys.exit(main())
