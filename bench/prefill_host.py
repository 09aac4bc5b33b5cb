"""The host's work per prefill step (a step that admits new requests), measured on any CPU.

    python -m bench.prefill_host                          # make bench-prefill-host
    python -m bench.prefill_host --rounds 5 --baseline-tree ../old-checkout
    python -m bench.prefill_host --modes sync --baseline-tree ../step1 --baseline-tree ../step2

nano-vllm's prompt shape: 256 requests, prompt lengths uniform in 100-1024, ids random below
10,000 (bench/workload.py), max_num_batched_tokens 16384, every request producing --max-tokens
(1: every step is a prefill step). The model is a 1-layer, hidden-64 one with a 10,000-id
vocabulary, and the device is simulated at 0 ms per step (worker_service/runner/
simulated_device.py), so a step's wall time is all host work: scheduling, prefix-cache hashes
and block allocation, the diff's encode, decode and check, the runner's batch and step inputs,
the reply and the output processing. On a GPU that work is the device's idle time between
prefill steps whenever it exceeds the forward pass's.

Lanes: sync scheduling (one step in flight: the sum is the host's critical path) and async (the
engine and runner threads overlap but share the GIL). Each lane runs --rounds times in fresh
processes, alternating with --baseline-tree when given; prints ms per prefill step and per new
request (the run's wall time over them), and the process's CPU time per prefill step (all
its threads: steadier than the wall time on a shared machine), min / median / max over the
rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench import child_rounds
from bench.child_rounds import alternating_rounds, spread, tiny_model_dir
from bench.isa import describe_cpu
from bench.report import git_commit, print_and_append

CHILD = Path(__file__).resolve().parent / "prefill_host_child.py"
VOCAB_SIZE = 10_000      # bench/workload.py draws prompt ids below 10,000 (ids the 512-id
                         # tokenizer lacks detokenize to nothing)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_host",
                                description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=256, help="requests (default: 256)")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="tokens per request (default: 1: only prefill steps)")
    p.add_argument("--modes", default="sync,async",
                   help="scheduling lanes, comma-separated (default: sync,async)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each lane (default: 3)")
    p.add_argument("--baseline-tree", action="append", default=[],
                   help="another checkout: the same runs there, alternating with this one "
                        "(repeatable: each change of a series against the same rounds)")
    p.add_argument("--results-file", default=None, help="append the block here")
    return p


def run_child(tree: Path, model: str, args, async_scheduling: bool) -> dict:
    return child_rounds.run_child(CHILD, tree, [model, str(args.num_seqs), str(args.max_tokens),
                                                "1" if async_scheduling else "0"])


def lane(args, model: str, async_scheduling: bool) -> list[str]:
    runs = alternating_rounds(args.rounds, args.baseline_tree,
                              lambda tree: run_child(tree, model, args, async_scheduling))
    mode = "async" if async_scheduling else "sync"
    lines = [f"{mode} scheduling (ms, min / median / max over the rounds):"]
    medians = {}
    for name, rounds in runs.items():
        per_step = [r["wall_ms"] / r["prefill_steps"] for r in rounds]
        per_req = [r["wall_ms"] / r["new_requests"] for r in rounds]
        medians[name] = statistics.median(per_step)
        first = rounds[0]
        lines.append(f"  {name}: per prefill step {spread(per_step, 1)}, per new request "
                     f"{spread(per_req, 3)} ({first['prefill_steps']} prefill steps of "
                     f"{first['steps']}, {first['new_requests']} requests, "
                     f"{first['prompt_tokens']} prompt tokens)")
        cpu = [r["cpu_ms"] / r["prefill_steps"] for r in rounds]
        lines.append(f"    {'CPU per prefill step':24s} {spread(cpu, 1)}")
        steps = [statistics.median(r["prefill_step_ms"]) for r in rounds]
        lines.append(f"    {'median step() admitting':24s} {spread(steps, 1)}")
        for phase in first["phases_ms"]:
            if phase != "step":
                per = [r["phases_ms"][phase] / r["prefill_steps"] for r in rounds]
                lines.append(f"    {phase + ' per step':24s} {spread(per, 1)}")
    ours = medians.pop("this tree")
    for name, base in medians.items():
        lines.append(f"  this tree / {name} (median per prefill step): {ours / base:.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = tiny_model_dir("prefill-host", vocab_size=VOCAB_SIZE)
    lines = [f"## prefill host work, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"commit {git_commit()}", "",
             f"{describe_cpu()}; simulated device 0 ms/step; model: 1 layer, hidden 64, "
             f"vocab {VOCAB_SIZE}; {args.num_seqs} requests, prompts 100-1024 tokens, "
             f"max_tokens {args.max_tokens}, max_num_batched_tokens 16384, 1 torch thread, "
             f"{args.rounds} rounds", ""]
    for mode in args.modes.split(","):
        if mode not in ("sync", "async"):
            raise SystemExit(f"--modes: {mode!r} is not sync or async")
        lines += lane(args, model, mode == "async")
    return print_and_append(lines, "bench.prefill_host", argv, args.results_file)


if __name__ == "__main__":
    sys.exit(main())
