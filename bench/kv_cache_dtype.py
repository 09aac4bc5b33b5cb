"""--kv-cache-dtype on the CPU: the attention part of one decode step, auto (bfloat16) vs fp8.

    python -m bench.kv_cache_dtype [--reqs 64] [--context 2048] [--layers 30] [--rounds 5]

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head 64, 30 layers; bfloat16),
`reqs` decodes of `context` tokens each, blocks of 16 scattered over each layer's own cache:
one round is the paged kernel (kernels/cpu/csrc/paged_attention.cpp) over every layer, as a
decode step runs it; the dtypes take turns within each round. The caches are written once
(random values), not timed. Also printed: the blocks one GiB of --kv-cache-gib holds for this
model in each cache dtype.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.attention.torch_ref import to_cache_dtype
from kernels.cpu import extension

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CACHE_DTYPES = {"auto": torch.bfloat16, "fp8_e5m2": torch.float8_e5m2,
                "fp8_e4m3": torch.float8_e4m3fn}


def block_bytes(layers: int, dtype: torch.dtype) -> int:
    """One block of every layer, keys and values (runner_kv_cache.kv_block_bytes)."""
    return 2 * layers * BLOCK * KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def make_caches(reqs: int, context: int, layers: int, dtype: torch.dtype, gen):
    blocks_per_req = -(-context // BLOCK)
    num_blocks = reqs * blocks_per_req
    base = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    one = base.to(dtype) if dtype == torch.bfloat16 else to_cache_dtype(base, dtype).view(dtype)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(reqs, blocks_per_req)
    return [one.clone() for _ in range(layers)], table


def time_steps(op, runs: dict, reqs: int, context: int, rounds: int, gen) -> dict:
    """Milliseconds of each round per cache dtype; the dtypes take turns within a round (a
    shared machine's load then weighs on each alike); a first round warms up, untimed."""
    query = torch.randn(reqs, HEADS, HEAD_DIM, generator=gen).bfloat16()
    out = torch.empty_like(query)
    starts = torch.arange(reqs + 1, dtype=torch.int32)
    lens = torch.full((reqs,), context, dtype=torch.int32)
    times = {name: [] for name in runs}
    for _ in range(rounds + 1):
        for name, (caches, table) in runs.items():
            t0 = time.perf_counter()
            for cache in caches:
                op(query, cache, table, starts, lens, HEAD_DIM ** -0.5, out, 0, None)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: ms[1:] for name, ms in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reqs", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    if not extension.load():
        raise SystemExit(f"the cpu kernel is not built: {extension.status()}")
    torch.set_num_threads(args.threads)
    op = extension.ops().paged_attention
    gen = torch.Generator().manual_seed(0)
    print(f"{args.reqs} decodes x {args.context} context, {args.layers} layers, "
          f"{args.threads} threads, isa {extension.isa()}")
    runs = {name: make_caches(args.reqs, args.context, args.layers, dtype, gen)
            for name, dtype in CACHE_DTYPES.items()}
    times = time_steps(op, runs, args.reqs, args.context, args.rounds, gen)
    for name, ms in times.items():
        cache_mib = sum(c.nbytes for c in runs[name][0]) / 2 ** 20
        print(f"{name:9s} cache {cache_mib:7.0f} MiB  step ms min {min(ms):7.1f} median "
              f"{statistics.median(ms):7.1f} max {max(ms):7.1f}  blocks/GiB "
              f"{(1 << 30) // block_bytes(args.layers, CACHE_DTYPES[name])}")


if __name__ == "__main__":
    main()
