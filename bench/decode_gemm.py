"""Decode-shaped GEMMs on a GPU: how near the weight-read floor cuBLAS (F.linear) runs at the
batch sizes of a decode step, against a split-K Triton GEMM, for one preset's projections.

    python -m bench.decode_gemm --preset qwen3-0.6b                 # on a GPU
    python -m bench.decode_gemm --preset tiny --device cpu --batches 4 --reps 1   # a smoke run

A decode step reads every projection weight once for M = batch rows. On an H100 at batch ~244
the four projections of Qwen3-0.6B took 0.84 ms a step, ~0.35 of the copy bandwidth for their
bytes (bench/results.md, 2026-11-27): each is a few microseconds of work spread over too few
output tiles to fill 132 SMs. This says, per (projection, M), how long F.linear takes and how
long the best of kernels/decode_gemm.py's Triton tile shapes and split-K factors takes (outputs checked
against F.linear first), both as microseconds per call and as the fraction of the copy
bandwidth their weight bytes stand for. On CUDA each case is timed as a CUDA graph of
`--calls` back-to-back calls (what a decode graph replays), best of `--reps` replays. Nothing
is written to results files: it informs whether a decode GEMM of our own can pay.
"""
from __future__ import annotations

import argparse
import sys
import time

from bench.kernel_timing import resolve_kernel_bench_device, time_graph


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.decode_gemm",
                                description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-0.6b", help="the shapes' source (default: qwen3-0.6b)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--batches", default="16,64,128,256",
                   help="rows M to time (default: 16,64,128,256)")
    p.add_argument("--calls", type=int, default=20, help="calls per timed graph (default: 20)")
    p.add_argument("--reps", type=int, default=5, help="timed replays, best kept (default: 5)")
    p.add_argument("--time-budget", type=float, default=90.0,
                   help="seconds for the Triton grid; configs left untried are named (default: 90)")
    return p


def projection_shapes(preset_name: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one layer's projections (q/k/v and gate/up merged, as the engine runs
    them) and the LM head, from the preset's config."""
    from bench.presets import PRESETS

    c = PRESETS[preset_name].config
    h = c.get("hidden_size", 64)
    d = c.get("head_dim", h // c.get("num_attention_heads", 4))
    q, kv = c.get("num_attention_heads", 4) * d, c.get("num_key_value_heads", 2) * d
    inter = c.get("intermediate_size", 128)
    return [("qkv_proj", q + 2 * kv, h), ("o_proj", h, q), ("gate_up_proj", 2 * inter, h),
            ("down_proj", h, inter), ("lm_head", c.get("vocab_size", 512), h)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = resolve_kernel_bench_device(args.device)
    import torch
    import torch.nn.functional as F

    from bench.bandwidth import measure_copy_bandwidth
    from kernels.decode_gemm import CONFIGS, split_k_linear

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    copy_bps = measure_copy_bandwidth(device)
    batches = [int(b) for b in args.batches.split(",")]
    deadline = time.perf_counter() + args.time_budget
    print(f"device {device}, {dtype}, copy bandwidth {copy_bps / 1e9:.0f} GB/s; "
          f"us per call (fraction of the copy bandwidth for the weight bytes)")
    print("| projection | N x K | M | F.linear | best Triton | its config | Triton/F.linear |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    gen = torch.Generator(device="cpu").manual_seed(0)
    untried = 0
    for name, n, k in projection_shapes(args.preset):
        weight = (torch.randn(n, k, generator=gen) * 0.02).to(device, dtype)
        for m in batches:
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            ref = F.linear(x, weight)
            base = time_graph(lambda: F.linear(x, weight), device, args.calls, args.reps)
            best, best_cfg = float("inf"), None
            for cfg in CONFIGS:
                if time.perf_counter() > deadline:
                    untried += 1
                    continue
                out = split_k_linear(x, weight, *cfg)
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                if not torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol):
                    print(f"  {name} M={m} {cfg}: output differs from F.linear "
                          f"(max {float((out.float() - ref.float()).abs().max()):.3g})")
                    continue
                t = time_graph(lambda: split_k_linear(x, weight, *cfg), device, args.calls,
                               args.reps)
                if t < best:
                    best, best_cfg = t, cfg
            frac = lambda s: n * k * weight.element_size() / s / copy_bps   # noqa: E731
            triton_cell = (f"{best * 1e6:.1f} ({frac(best):.2f})" if best_cfg else "-")
            ratio = f"{best / base:.2f}" if best_cfg else "-"
            print(f"| {name} | {n} x {k} | {m} | {base * 1e6:.1f} ({frac(base):.2f}) | "
                  f"{triton_cell} | {best_cfg} | {ratio} |")
    if untried:
        print(f"time budget reached: {untried} (case, config) pairs untried")
    return 0


if __name__ == "__main__":
    sys.exit(main())
