"""The CPU linears' three many-row layouts side by side: the weight panels (panel_gemm.cpp),
MKL's packed GEMM (float32 cblas_sgemm_compute / bf16 cblas_gemm_bf16bf16f32) and oneDNN's
blocked GEMM (kernels/cpu/onednn_gemm.py), over 30 layers of SmolLM2-135M's projection shapes
(qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536) so the weights stream from memory as
in a model, at each row count. Rounds alternate the layouts; best round per layout, GFLOP/s.
This is what the row thresholds in kernels/cpu/linear.py were read from.

    python -m bench.cpu_gemm_layouts [--rows 1,4,8,16,32,48,64,128,256,2048] [--threads 1]
                                     [--dtype float32|bfloat16] [--rounds 7]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench.isa import describe_cpu
from kernels.cpu import extension, onednn_gemm

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def _layouts(dtype: torch.dtype):
    ops = extension.ops()
    weights = [torch.randn(n, k).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    panels = [ops.panel_pack(w) for w in weights]
    runs = {"panels": lambda xs: [ops.panel_linear(xs[w.shape[1]], p, w.shape[0], None)
                                  for w, p in zip(weights, panels)]}
    if dtype == torch.float32:
        packed = [ops.mkl_pack(w) for w in weights]
        runs["mkl"] = lambda xs: [ops.mkl_packed_linear(xs[w.shape[1]], p, w.shape[0], None)
                                  for w, p in zip(weights, packed)]
    else:
        runs["mkl"] = lambda xs: [ops.mkl_bf16_linear(xs[w.shape[1]], w, None) for w in weights]
    try:
        dnn = [onednn_gemm.pack(w) for w in weights]
    except RuntimeError as e:          # bf16 without AVX-512 or AVX-NE-CONVERT: no oneDNN kernel
        print(f"oneDNN left out: {str(e).splitlines()[0]}")
        return runs
    runs["onednn"] = lambda xs: [onednn_gemm.linear(xs[w.shape[1]], p, None)
                                 for w, p in zip(weights, dnn)]
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_gemm_layouts",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,8,16,32,48,64,128,256,2048")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    if not extension.load():
        print(f"deltaserve_cpu not loaded: {extension.status()}")
        return 1
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    runs = _layouts(dtype)
    flop_per_row = 2 * LAYERS * sum(n * k for n, k in SHAPES)
    print(f"cpu: {describe_cpu()}; {args.dtype}, {args.threads} thread(s), {LAYERS} layers, "
          f"best of {args.rounds} alternating rounds, GFLOP/s")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in SHAPES}}
        best = {name: float("inf") for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run(xs)
                best[name] = min(best[name], time.perf_counter() - start)
        fastest = min(best, key=best.get)
        print(f"rows {rows:5d}: " + "  ".join(
            f"{name} {flop_per_row * rows / t / 1e9:6.1f}" for name, t in best.items())
            + f"   fastest: {fastest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
