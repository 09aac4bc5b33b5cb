"""Decode attention over DeepSeek's MLA latent on the CPU: the C++ paged kernel (the `cpu`
backend, kernels/cpu/csrc/attention_latent.h) against the torch backend, one decode step of one
layer, alternating in one process:

    python -m bench.mla_decode_attention [--dtype float32|bfloat16] [--rounds 3] [--iters 5]
                                         [--threads 1] [--shapes v2-lite,v3]

Shapes (query heads on the one latent head of 576 = kv_lora_rank 512 + rope 64; values its
first 512): V2-Lite (16 heads) and a V3 rank (128 heads: V3's heads at TP=1), each 64 requests
x 512 tokens of context in blocks of 16, shuffled. Each round times --iters calls of each
backend (the torch one first on even rounds) and keeps the fastest call's thread CPU time (on a
shared machine wall time mostly measures the neighbours; with one thread both run on the
calling thread); the lines give min / median / max over the rounds and the GFLOP/s of the
median: 2 x heads x (576 + 512) x context per request. The latent cache is one row per token
shared by every head, so a step reads little (64 x 512 x 576 elements) and the heads' products
decide it. Before timing, the two backends' outputs are compared (relative L2 error).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.attention.backend import AttentionMetadata

SHAPES = {"v2-lite": 16, "v3": 128}       # query heads per rank on the latent head
LATENT, VALUE, BLOCK = 576, 512, 16


def decode_case(heads: int, num_reqs: int, context: int, dtype: torch.dtype):
    """query [R, heads, 576], the latent row of the step [R, 1, 576], a stride-0 cache, meta."""
    gen = torch.Generator().manual_seed(heads)
    per_req = -(-context // BLOCK)
    blocks = num_reqs * per_req + 1
    base = torch.randn(blocks, BLOCK, 1, LATENT, generator=gen).to(dtype)
    table = torch.randperm(blocks, generator=gen)[:num_reqs * per_req].to(torch.int32)
    table = table.reshape(num_reqs, per_req).contiguous()
    lens = torch.full((num_reqs,), context, dtype=torch.int32)
    pos = context - 1
    slots = table[:, pos // BLOCK].long() * BLOCK + pos % BLOCK
    starts = torch.arange(num_reqs + 1, dtype=torch.int32)
    meta = AttentionMetadata(num_reqs=num_reqs, num_actual_tokens=num_reqs, max_query_len=1,
                             max_seq_len=context, query_start_loc=starts, seq_lens=lens,
                             block_table=table, slot_mapping=slots,
                             query_start_loc_cpu=starts, seq_lens_cpu=lens)
    query = torch.randn(num_reqs, heads, LATENT, generator=gen).to(dtype)
    latent = torch.randn(num_reqs, 1, LATENT, generator=gen).to(dtype)
    return query, latent, base.unsqueeze(0).expand(2, *base.shape), meta


def step(backend, case, scale: float) -> torch.Tensor:
    query, latent, cache, meta = case
    if getattr(backend, "supports_value_prefix", False):
        return backend.forward(query, latent, latent, cache, meta, scale, v_head_dim=VALUE)
    return backend.forward(query, latent, latent, cache, meta, scale)[..., :VALUE]


def fastest(backend, case, scale: float, iters: int) -> float:
    """The fastest of iters calls, thread CPU seconds."""
    best = float("inf")
    for _ in range(iters):
        t0 = time.thread_time()
        step(backend, case, scale)
        best = min(best, time.thread_time() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-reqs", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args(argv)
    for name, value in (("rounds", args.rounds), ("iters", args.iters), ("threads", args.threads),
                        ("num-reqs", args.num_reqs), ("context", args.context)):
        if value < 1:
            p.error(f"--{name}={value} is invalid: must be >= 1")
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        p.error(f"--shapes: {unknown} unknown: pick from {list(SHAPES)}")
    torch.set_num_threads(args.threads)
    from kernels.attention.cpu_paged import CpuPagedAttentionBackend
    from kernels.attention.torch_ref import TorchAttentionBackend
    backends = {"cpu": CpuPagedAttentionBackend(), "torch": TorchAttentionBackend()}
    dtype = getattr(torch, args.dtype)
    scale = 192 ** -0.5
    print(f"MLA decode attention, {args.num_reqs} requests x {args.context}, {args.dtype}, "
          f"{args.threads} thread(s), fastest of {args.iters} calls (thread CPU time), "
          f"{args.rounds} rounds")
    for name in shapes:
        heads = SHAPES[name]
        case = decode_case(heads, args.num_reqs, args.context, dtype)
        ref, got = (step(backends[b], case, scale).float() for b in ("torch", "cpu"))
        err = ((got - ref).norm() / ref.norm()).item()
        times = {b: [] for b in backends}
        for r in range(args.rounds):
            for b in (("torch", "cpu") if r % 2 == 0 else ("cpu", "torch")):
                times[b].append(fastest(backends[b], case, scale, args.iters))
        flops = 2 * heads * (LATENT + VALUE) * args.context * args.num_reqs
        print(f"{name} ({heads} heads): cpu vs torch relative error {err:.2e}")
        for b, ts in times.items():
            med = statistics.median(ts)
            print(f"  {b:5s} {min(ts) * 1e3:8.2f} / {med * 1e3:8.2f} / {max(ts) * 1e3:8.2f} ms"
                  f"  {flops / med / 1e9:6.1f} GFLOP/s")
        print(f"  cpu / torch: {statistics.median(times['torch']) / statistics.median(times['cpu']):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
