"""MoE experts microbenchmark: the grouped torch path against the fused Triton kernels.

    python -m bench.moe_experts                     # CUDA: Qwen3-30B-A3B's experts, bf16
    python -m bench.moe_experts --device cpu --num-tokens 3 --experts 8 --top-k 2 \\
        --hidden 64 --inter 32                      # the CPU smoke run (Triton interpreter)
    python -m bench.moe_experts --device cpu --cpu-kernels --experts 64 --hidden 1024 \\
        --inter 512 --dtype float32                 # the CPU's packed experts (bench/moe_cpu.py)
    python -m bench.moe_experts --device cpu --cpu-kernels --gpt-oss --experts 32 --top-k 4 \\
        --hidden 2880 --inter 2880                  # the same, gpt-oss-20b's layer

One sparse layer's routed experts (worker_service/layers/moe.py MoEExperts; defaults: 128
experts, top-8, hidden 2048, moe_intermediate 768, as Qwen3-30B-A3B's 48 sparse layers), random
weights (std 0.02) and a softmax-top-k routing of random logits, per token count T:

    grouped        the torch path: one host sync, one GEMM pair per expert that has tokens
    fused          kernels/fused_moe.py eagerly (alignment + two grouped GEMMs + the k-sum)
    fused graph    the same captured once in a CUDA graph and replayed (CUDA only): what a
                   decode step pays per layer once graphs capture MoE models

--block-n / --block-k / --small-block-m override the kernels' (untuned) tile sizes, for a sweep
of one run per setting. Before timing, fused is checked against grouped (relative L2 error; a
failed check exits 1). Timing: warm-up calls, then CUDA events around each call (CPU:
perf_counter), median.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.kernel_timing import resolve_kernel_bench_device, time_calls
from bench.report import print_and_append

# relative L2 error allowed; bf16 on CPU: the interpreter truncates each float32 -> bf16 cast
# (a GPU rounds to nearest), and the fused chain's five casts shrink the output by ~1.7%
CHECK_TOL = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}
SIZE_DEFAULTS = {"cuda": ("1,8,32,128,256,2048", 100, 10), "cpu": ("3", 2, 1),
                 "cpu-kernels": ("1,8,32", 10, 2)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.moe_experts",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--num-tokens", help="comma-separated token counts T (CUDA 1..2048; CPU 3)")
    add("--experts", type=int, default=128)
    add("--top-k", type=int, default=8)
    add("--hidden", type=int, default=2048)
    add("--inter", type=int, default=768, help="moe_intermediate_size (one rank's)")
    add("--dtype", choices=sorted(CHECK_TOL), default="bfloat16")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if any")
    add("--iters", type=int, help="timed calls per path (CUDA 100, CPU 2)")
    add("--warmup", type=int, help="untimed calls first (CUDA 10, CPU 1)")
    add("--block-n", type=int, help="override kernels/fused_moe.BLOCK_N (columns per program)")
    add("--block-k", type=int, help="override kernels/fused_moe.BLOCK_K (reduction step)")
    add("--small-block-m", type=int, help="override kernels/fused_moe.SMALL_BLOCK_M (rows per "
        "block while pairs <= 4 x experts; >= 16)")
    add("--cpu-kernels", action="store_true", help="CPU only: the whole sparse block, grouped "
        "torch path vs the packed kernels (kernels/cpu/moe_experts.py) vs transformers' block, "
        "in alternating rounds (bench/moe_cpu.py) instead of grouped vs fused")
    add("--rounds", type=int, default=3, help="with --cpu-kernels: alternating rounds")
    add("--thread-time", action="store_true", help="with --cpu-kernels: time each call by "
        "this thread's CPU time (with OMP_NUM_THREADS=1 the whole call), not the wall clock: "
        "for a shared machine")
    add("--gpt-oss", action="store_true", help="with --cpu-kernels: GPT-OSS's sparse block "
        "(expert biases, clamped SwiGLU) instead of Qwen3-MoE's; gpt-oss-20b's layer: "
        "--experts 32 --top-k 4 --hidden 2880 --inter 2880")
    add("--no-extra", action="store_true", help="with --cpu-kernels: time only grouped, "
        "unreleased and packed (not transformers' block or the dense MLP)")
    add("--results-file", help="Markdown file the result block is appended to (default: none)")
    return p


def apply_tile_overrides(args) -> str:
    """Set the kernels' tile sizes from the flags (a sweep, one run per setting); describe them."""
    from kernels import fused_moe as fm

    for flag, name in (("block_n", "BLOCK_N"), ("block_k", "BLOCK_K"),
                       ("small_block_m", "SMALL_BLOCK_M")):
        value = getattr(args, flag)
        if value is not None:
            setattr(fm, name, value)
    return (f"tiles: BLOCK_N {fm.BLOCK_N}, BLOCK_K {fm.BLOCK_K}, BLOCK_M {fm.SMALL_BLOCK_M} "
            f"(pairs <= 4 x experts) else {fm.LARGE_BLOCK_M}")


def make_experts(args, device: str, dtype: torch.dtype):
    from worker_service.layers.moe import MoEExperts
    from worker_service.parallel_state import single_rank_group

    torch.manual_seed(0)
    with torch.device(device):
        m = MoEExperts(args.experts, args.hidden, args.inter, single_rank_group(), dtype)
    with torch.no_grad():
        m.w13_weight.normal_(0.0, 0.02)
        m.w2_weight.normal_(0.0, 0.02)
    return m


def graph_call(call, device: str):
    """call captured once in a CUDA graph: a replay; None off CUDA."""
    if device != "cuda":
        return None
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def run_one(m, num_tokens: int, args, device: str, dtype: torch.dtype) -> tuple[str, bool]:
    x = torch.randn(num_tokens, args.hidden, device=device).to(dtype)
    logits = torch.randn(num_tokens, args.experts, device=device)
    weights, ids = torch.topk(torch.softmax(logits, -1), args.top_k, dim=-1)
    weights = weights.to(dtype)

    def path(fused: bool):
        def call():
            m.fused_moe = fused
            with torch.no_grad():
                return m(x, weights, ids)
        return call

    grouped, fused = path(False), path(True)
    want, got = grouped().float(), fused().float()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    ok = err <= CHECK_TOL[args.dtype]
    if not ok:
        return f"T={num_tokens}: CHECK FAILED, relative L2 error {err:.3g}", False
    times = {"grouped": time_calls(grouped, device, args.iters, args.warmup),
             "fused": time_calls(fused, device, args.iters, args.warmup)}
    replay = graph_call(fused, device)
    if replay is not None:
        times["fused graph"] = time_calls(replay, device, args.iters, args.warmup)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    best = min(ms["fused"], ms.get("fused graph", ms["fused"]))
    parts = ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
    return (f"T={num_tokens}: {parts}; grouped / best fused {ms['grouped'] / best:.2f}x "
            f"(error {err:.2g})"), True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cpu_kernels and args.device == "cuda":
        raise SystemExit("--cpu-kernels needs --device cpu")
    if args.gpt_oss and not args.cpu_kernels:
        raise SystemExit("--gpt-oss needs --cpu-kernels")
    device = "cpu" if args.cpu_kernels else resolve_kernel_bench_device(args.device)
    sizes, iters, warmup = SIZE_DEFAULTS["cpu-kernels" if args.cpu_kernels else device]
    args.iters = args.iters or iters
    args.warmup = args.warmup if args.warmup is not None else warmup
    dtype = getattr(torch, args.dtype)
    if args.cpu_kernels:
        from bench.moe_cpu import run

        lines, ok = run(args, dtype, args.num_tokens or sizes)
        print_and_append(lines, "bench.moe_experts", argv, args.results_file)
        return 0 if ok else 1
    m = make_experts(args, device, dtype)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"## MoE experts, {name}: E={args.experts} top-{args.top_k} H={args.hidden} "
             f"I={args.inter} {args.dtype}", "", f"- {apply_tile_overrides(args)}"]
    ok = True
    for t in (int(s) for s in (args.num_tokens or sizes).split(",")):
        line, good = run_one(m, t, args, device, dtype)
        lines.append(f"- {line}")
        ok = ok and good
    print_and_append(lines, "bench.moe_experts", argv, args.results_file)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
