"""Prefill attention alone on the CPU (kernels/cpu's paged attention, one causal prompt batch),
this tree against a baseline checkout, in alternating child processes:

    python -m bench.cpu_prefill_attention [--baseline-tree DIR] [--dtype bfloat16|float32]
                                          [--rounds 3] [--threads 1]

Shapes: SmolLM2-135M's attention (9 query / 3 KV heads x 64; 4 prompts of 512 tokens) and a
Llama-8B-shaped one (32 / 8 x 128; 2 of 512). A child times --iters calls after a warm-up and
reports the fastest call's thread CPU time (on a shared machine wall time mostly measures the
neighbours), the causal FLOPs per second that makes, and the first prompt's relative L2 error
against float32 attention over the same (rounded) inputs. Each line gives min / median / max
over the rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.child_rounds import REPO, run_child

SHAPES = {"smollm2 4x512": (4, 512, 9, 3, 64), "llama-8b 2x512": (2, 512, 32, 8, 128)}
BLOCK = 16


def _case(num_reqs, length, heads, kv_heads, head_dim, dtype):
    import torch

    gen = torch.Generator().manual_seed(length + heads)
    blocks = num_reqs * -(-length // BLOCK)
    kv = torch.randn(2, blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen).to(torch.int32).reshape(num_reqs, -1)
    q = torch.randn(num_reqs * length, heads, head_dim, generator=gen).to(dtype)
    starts = torch.arange(0, num_reqs * length + 1, length, dtype=torch.int32)
    lens = torch.full((num_reqs,), length, dtype=torch.int32)
    return q, kv, table.contiguous(), starts, lens


def _first_prompt_error(q, kv, table, out, length, heads, kv_heads) -> float:
    import torch

    group = heads // kv_heads
    rows = kv[:, table[0].long()].flatten(1, 2)[:, :length].float()        # [2, L, Hkv, D]
    k, v = (rows[i].repeat_interleave(group, 1).transpose(0, 1) for i in (0, 1))
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:length].float().transpose(0, 1), k, v, is_causal=True).transpose(0, 1)
    return ((out[:length].float() - want).norm() / want.norm()).item()


def child(dtype_name: str, threads: int, iters: int) -> dict:
    import torch

    from kernels.cpu import extension

    torch.set_num_threads(threads)
    if not extension.load():
        raise SystemExit(f"kernels/cpu did not load: {extension.status()}")
    ops, dtype, result = extension.ops(), getattr(torch, dtype_name), {}
    for name, (num_reqs, length, heads, kv_heads, head_dim) in SHAPES.items():
        q, kv, table, starts, lens = _case(num_reqs, length, heads, kv_heads, head_dim, dtype)
        out = torch.empty_like(q)
        call = lambda: ops.paged_attention(q, kv, table, starts, lens, head_dim ** -0.5, out, 0)  # noqa: E731
        call()
        best = float("inf")
        for _ in range(iters):
            start = time.thread_time()
            call()
            best = min(best, time.thread_time() - start)
        flops = num_reqs * length * length / 2 * head_dim * 4 * heads     # QK and PV, causal
        result[name] = dict(ms=best * 1e3, gflops=flops / best / 1e9,
                            error=_first_prompt_error(q, kv, table, out, length, heads, kv_heads))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_prefill_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-tree", type=Path, help="a checkout to time alongside this tree")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.dtype, args.threads, args.iters)))
        return 0
    from bench.isa import describe_cpu

    trees = {"this tree": REPO, **({"baseline": args.baseline_tree} if args.baseline_tree else {})}
    child_argv = ["--child", "--dtype", args.dtype, "--threads", str(args.threads),
                  "--iters", str(args.iters)]
    runs = {label: [] for label in trees}
    for _ in range(args.rounds):
        for label, tree in trees.items():
            runs[label].append(run_child(REPO / "bench" / "cpu_prefill_attention.py", tree,
                                         child_argv))
    print(f"cpu: {describe_cpu()}; {args.dtype}, {args.threads} thread(s), {args.rounds} rounds "
          f"(thread CPU ms of the fastest of {args.iters} calls: min / median / max)")
    for name in SHAPES:
        for label, rounds in runs.items():
            ms = sorted(r[name]["ms"] for r in rounds)
            gf = statistics.median(r[name]["gflops"] for r in rounds)
            print(f"{name:>16}  {label:>10}: {ms[0]:7.2f} / {statistics.median(ms):7.2f} / "
                  f"{ms[-1]:7.2f} ms  {gf:6.1f} GFLOP/s  rel. error {rounds[0][name]['error']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
