"""The rope alone on the CPU at a Phi-4-mini layer's shape (24 query heads, 8 KV heads, head_dim
128, partial_rotary_factor 0.75: the first 96 dims of each head rotate), per token count T:

    torch     RotaryEmbedding's torch code (gather cos/sin, rotate, concatenate the tail): what
              a partial-rotary model ran before kernels/cpu's rope took partial heads
    cpu       the same module after use_cpu_kernels(): kernels/cpu's rope, in place
    cpu-full  kernels/cpu's rope on whole heads (rotary_dim 128), for scale

q and k are views of one qkv row, as in the model. Rounds alternate the paths; a round's figure
is the median of --iters calls after --warmup; each line gives the median over --rounds rounds.

    python -m bench.cpu_rope [--tokens 1,16,128,512] [--dtype bfloat16|float32] [--rounds 5]
                             [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.isa import describe_cpu
from bench.kernel_timing import time_calls
from kernels.cpu import extension
from worker_service.layers.rotary import RopeSettings, RotaryEmbedding

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PARTIAL = 24, 8, 128, 0.75
MAX_POSITION = 4096


def _paths(num_tokens: int, dtype: torch.dtype) -> dict:
    """path name -> a call rotating fresh-shaped q, k at random positions."""
    gen = torch.Generator().manual_seed(num_tokens)
    width = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)
    q = qkv[:, :NUM_Q_HEADS * HEAD_DIM].view(num_tokens, NUM_Q_HEADS, HEAD_DIM)
    k = qkv[:, NUM_Q_HEADS * HEAD_DIM:(NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(
        num_tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    ropes = {}
    for name, factor in (("torch", PARTIAL), ("cpu", PARTIAL), ("cpu-full", 1.0)):
        rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION,
                               RopeSettings(theta=10000.0, partial_rotary_factor=factor))
        if name != "torch" and not rope.use_cpu_kernels():
            raise SystemExit(f"kernels/cpu did not load: {extension.status()}")
        ropes[name] = rope
    return {name: (lambda r=rope: r(positions, q, k)) for name, rope in ropes.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_rope", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,128,512")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch / OpenMP threads (1: steady figures on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"cpu: {describe_cpu()}; kernels/cpu build: {extension.isa()}; {args.dtype}, "
          f"{torch.get_num_threads()} thread(s); Phi-4-mini layer: {NUM_Q_HEADS}q/"
          f"{NUM_KV_HEADS}kv heads x {HEAD_DIM}, rotary_dim {int(HEAD_DIM * PARTIAL)}")
    print(f"{'T':>6} {'torch us':>10} {'cpu us':>10} {'cpu-full us':>12} {'torch/cpu':>10}")
    with torch.no_grad():
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            paths = _paths(num_tokens, dtype)
            rounds = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, call in paths.items():
                    seconds = time_calls(call, "cpu", args.iters, args.warmup)
                    rounds[name].append(statistics.median(seconds) * 1e6)
            us = {name: statistics.median(r) for name, r in rounds.items()}
            print(f"{num_tokens:>6} {us['torch']:>10.1f} {us['cpu']:>10.1f} "
                  f"{us['cpu-full']:>12.1f} {us['torch'] / us['cpu']:>9.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
