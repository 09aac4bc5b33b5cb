"""GPTQ int4 linears on the CPU kept packed (layers/quant_linear.py: torch's weight-only int4
kernel below kernels/cpu/int4_gemm.MIN_ROWS rows, the repo's panel kernel from there) against
the same weights dequantized at load (kernels/cpu/linear.py: panels / oneDNN / MKL, what
--cpu-quantized-weights dequantize runs): resident weight bytes, and the decode
throughput of the linear stack of a model of real shape, random GPTQ codes (group 128):

    layers x (qkv [3072, 2048], o [2048, 2048], gate_up [12288, 2048], down [2048, 6144])
    (hidden 2048, 16 heads of 128, 4 kv heads, intermediate 6144: a Qwen3-1.7B-like stack)

Each step runs every linear once on [M, K] rows (a decode step of M requests, attention and
norms left out: the linears are what reads the weights). Rounds alternate the two modes;
tokens/s = M x steps/s, reported min / median / max over the rounds.

    python -m bench.quant_cpu [--layers 8] [--rows 1,4,16,64,300] [--dtypes bfloat16]
                              [--rounds 3] [--steps 3]

float32 / float16 models are not run natively (quant_linear.NATIVE_DTYPES: torch's kernel is
scalar for them); asked for, the line says so.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.isa import describe_cpu
from kernels.cpu import linear as cpu_linear
from worker_service.layers.quant_linear import PackedBand, build, dequantize

SHAPES = ((3072, 2048), (2048, 2048), (12288, 2048), (2048, 6144))
GROUP = 128


def _band(n: int, k: int, gen: torch.Generator) -> PackedBand:
    groups = k // GROUP
    return PackedBand(torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8),
                      torch.randint(1, 17, (groups, n), generator=gen, dtype=torch.int32),
                      (0.002 * (0.5 + torch.rand(groups, n, generator=gen))).half(),
                      GROUP, 4)


def _stacks(layers: int, dtype: torch.dtype):
    """(native linears, dense (CpuLinear or None, weight) pairs, native bytes, dense bytes)."""
    gen = torch.Generator().manual_seed(0)
    native, dense = [], []
    for _ in range(layers):
        for n, k in SHAPES:
            band = _band(n, k, gen)
            native.append(build(band, dtype))
            w = dequantize(band).to(dtype)
            dense.append((cpu_linear.prepare(w), w))
    return (native, dense, sum(q.nbytes for q in native),
            sum(w.nbytes for _, w in dense))


def _step(mode: str, linears, xs: dict[int, torch.Tensor]) -> None:
    for lin in linears:
        if mode == "native":
            lin(xs[lin.in_features])
        else:
            cpu, w = lin
            (cpu or torch.nn.functional.linear)(xs[w.shape[1]], w, None)


def _tok_s(mode: str, linears, rows: int, dtype: torch.dtype, steps: int) -> float:
    xs = {k: torch.randn(rows, k).to(dtype) for k in (2048, 6144)}
    _step(mode, linears, xs)                               # warm
    start = time.perf_counter()
    for _ in range(steps):
        _step(mode, linears, xs)
    return rows * steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_cpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="1,4,16,64,300")
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"cpu: {describe_cpu()}; {torch.get_num_threads()} thread(s), {args.layers} layers, "
          f"GPTQ int4 group {GROUP}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        why = build(_band(16, GROUP, torch.Generator()), dtype)
        if isinstance(why, str):
            print(f"{name}: not run natively: {why}")
            continue
        native, dense, native_bytes, dense_bytes = _stacks(args.layers, dtype)
        print(f"{name}: weights native {native_bytes / 2**20:.0f} MiB (packed codes + scales "
              f"and zeros), dequantized {dense_bytes / 2**20:.0f} MiB (before the CPU GEMMs' "
              f"packed copies)")
        for m in rows:
            got = {"native": [], "dequantize": []}
            for r in range(args.rounds):
                order = ("native", "dequantize") if r % 2 == 0 else ("dequantize", "native")
                for mode in order:
                    got[mode].append(_tok_s(mode, native if mode == "native" else dense, m,
                                            dtype, args.steps))
            line = "  ".join(f"{mode} {min(v):8.1f} / {statistics.median(v):8.1f} / "
                             f"{max(v):8.1f}" for mode, v in got.items())
            ratio = statistics.median(got["native"]) / statistics.median(got["dequantize"])
            print(f"  M={m:4d} tok/s min/median/max: {line}  native/dequantized {ratio:.2f}x")
        del native, dense
    return 0


if __name__ == "__main__":
    sys.exit(main())
