"""The in-process engine on a named workload and the real model, this tree against others.

    python -m bench.cpu_tree_ab --workload prefill-heavy --baseline-tree ../before
    python -m bench.cpu_tree_ab --workload decode-heavy --num-seqs 64 --max-output 128 \\
        --baseline-tree ../before --rounds 5

What a CPU kernel change buys end to end: `LLM.generate` on bench/workload.py's workload
(SmolLM2-135M-Instruct, greedy, ignore_eos, one torch thread) in fresh processes, one per tree
and round, the trees alternating within each round so they share the machine's state. Prints
output tokens/s per tree (min / median / max over the rounds), the process CPU seconds, and
this tree's median over each baseline's. `make bench-peers` says where the engine stands
against vLLM-CPU; this says what one change between two commits did.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench import child_rounds
from bench.child_rounds import alternating_rounds, spread
from bench.isa import describe_cpu
from bench.report import git_commit, print_and_append
from bench.workload import NAMED_WORKLOADS

CHILD = Path(__file__).resolve().parent / "cpu_tree_ab_child.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_tree_ab",
                                description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(n for n in NAMED_WORKLOADS
                                                if n not in ("step-overhead", "smoke")),
                   default="prefill-heavy")
    p.add_argument("--num-seqs", type=int, default=0,
                   help="the workload's first N requests (default: all)")
    p.add_argument("--max-output", type=int, default=0,
                   help="cap every output length here (default: the workload's own)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline-tree", action="append", default=[],
                   help="another checkout, run alternating with this one (repeatable)")
    p.add_argument("--results-file", default=None, help="append the block here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    child_argv = [args.workload, str(args.num_seqs), str(args.max_output), args.dtype,
                  str(args.max_num_batched_tokens)]
    runs = alternating_rounds(args.rounds, args.baseline_tree,
                              lambda tree: child_rounds.run_child(CHILD, tree, child_argv))
    first = runs["this tree"][0]
    lines = [f"## cpu tree A/B, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"commit {git_commit()}", "",
             f"{describe_cpu()}; {args.workload}: {first['requests']} requests, "
             f"{first['tokens']} output tokens (outputs capped at {args.max_output or 'none'}), "
             f"{args.dtype}, max_num_batched_tokens {args.max_num_batched_tokens}, 1 torch "
             f"thread, {args.rounds} rounds, trees alternating", ""]
    medians = {}
    for name, rounds in runs.items():
        rates = [r["tokens"] / r["wall_s"] for r in rounds]
        medians[name] = statistics.median(rates)
        lines.append(f"- {name}: {spread(rates, 1)} tok/s (min / median / max); CPU "
                     f"{spread([r['cpu_s'] for r in rounds], 1)} s")
    ours = medians.pop("this tree")
    for name, base in medians.items():
        lines.append(f"- this tree / {name} (median tok/s): {ours / base:.2f}x")
    return print_and_append(lines, "bench.cpu_tree_ab", argv, args.results_file)


if __name__ == "__main__":
    sys.exit(main())
