"""Decode attention microbenchmark: one pure-decode batch per backend, against the copy ceiling.

Times only the attention backend's forward on the batch, and sets the bytes it must move against
the device's measured copy bandwidth.

    python -m bench.attention_bandwidth                      # 256 requests x 1024, triton
    python -m bench.attention_bandwidth --all-backends
    python -m bench.attention_bandwidth --device cpu --num-reqs 4 --context 64 --backend torch

Defaults: qwen3-0.6b's attention (16 query heads, 8 KV heads, head_dim 128, bf16), one layer.
The cache holds exactly the blocks the batch uses, shuffled into random block tables, filled
with random values (never zeros); at the CUDA default it is 1 GiB, far above any L2.

Bytes per call (the floor; MB/GB are powers of ten):

    KV read      num_reqs * context * num_kv_heads * head_dim * 2 (K and V) * elem
    Q read       num_reqs * num_heads * head_dim * elem
    O write      num_reqs * num_heads * head_dim * elem
    K/V write    num_reqs * num_kv_heads * head_dim * 2 * elem   (forward first writes this
                 step's key/value by slot mapping, here into each request's last position)

Block-table reads (4 bytes per block, under 0.1% at the default) are left out. Copy bandwidth
is bench/bandwidth.py's: bytes read plus bytes written by a large device copy. Timing: warm-up
calls, then CUDA events around each call, median (CPU: time.perf_counter). Before timing, the
first few requests' output is checked against the float32 reference (‖out − ref‖ / ‖ref‖); a
failed check makes the run exit 1.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine_common.params import ParamError

from bench.report import append_block, git_commit

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results.md"
BACKENDS = ("triton", "flash_attn", "torch")
FLASH_BLOCK_SIZE = 256      # flash-attn's paged kernels need blocks of a multiple of 256
CHECK_REQS = 4              # requests compared with the float32 reference
CHECK_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}   # relative L2 error
# (num_reqs, context, iterations, warm-up) when not given, per device type
SIZE_DEFAULTS = {"cuda": (256, 1024, 50, 5), "cpu": (8, 128, 5, 1)}


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.attention_bandwidth`."""
    p = argparse.ArgumentParser(prog="python -m bench.attention_bandwidth",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--num-reqs", type=int, help="requests in the batch (by device: CUDA 256, CPU 8)")
    add("--context", type=int, help="tokens in each request's KV (CUDA 1024, CPU 128)")
    add("--num-heads", type=int, default=16, help="query heads")
    add("--num-kv-heads", type=int, default=8, help="key/value heads")
    add("--head-dim", type=int, default=128, help="dimension of one head")
    add("--block-size", type=int, default=16,
        help=f"KV block size (flash_attn under --all-backends: {FLASH_BLOCK_SIZE})")
    add("--dtype", choices=sorted(CHECK_TOL), default="bfloat16", help="cache and query dtype")
    add("--backend", choices=BACKENDS, default="triton", help="attention backend")
    add("--all-backends", action="store_true", help="every backend available here, in turn")
    add("--decode-splits", type=int, help="triton: fixed split count (none: its heuristic)")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if any")
    add("--iters", type=int, help="timed calls (CUDA 50, CPU 5)")
    add("--warmup", type=int, help="untimed calls first (CUDA 5, CPU 1)")
    add("--seed", type=int, default=0, help="seed of the random batch")
    add("--note", action="append", default=[], help="a remark recorded with the result")
    add("--results-file", default=str(DEFAULT_RESULTS), help="Markdown file appended to")
    return p


@dataclass(frozen=True)
class Shape:
    num_reqs: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def bytes_per_call(self, elem: int) -> tuple[int, int]:
        """(KV bytes read, all other bytes moved: Q read, O written, this step's K/V written)."""
        kv = self.num_reqs * self.context * self.num_kv_heads * self.head_dim * 2 * elem
        q_o = 2 * self.num_reqs * self.num_heads * self.head_dim * elem
        new_kv = self.num_reqs * self.num_kv_heads * self.head_dim * 2 * elem
        return kv, q_o + new_kv

    def describe(self) -> str:
        return (f"{self.num_reqs} requests x {self.context} context, {self.num_heads} query "
                f"heads, {self.num_kv_heads} KV heads, head_dim {self.head_dim}, {self.dtype}")


@dataclass(frozen=True)
class BackendRun:
    label: str                  # backend name with its block size and settings
    seconds: list[float]        # one per timed call
    check_error: float          # relative L2 error against the float32 reference
    check_ok: bool

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.attention_bandwidth ARGS`: run, print, append to the results file."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "-m", "bench.attention_bandwidth", *argv])
    try:
        lines, ok = run(args)
    except ParamError as e:
        print(f"attention_bandwidth: error: {e}", file=sys.stderr)
        return 2
    for line in lines[1:]:
        print(line)
    block = "\n".join([lines[0], "", f"- commit: `{git_commit()}`", f"- command: `{command}`"]
                      + [f"- {line}" for line in lines[1:]]) + "\n"
    append_block(args.results_file, block)
    print(f"appended to {args.results_file}")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> tuple[list[str], bool]:
    """Every requested backend in turn. Returns (the block's lines, title first; all checks ok)."""
    from deltaserve.cli import resolve_device

    device = resolve_device(args.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise ParamError("device", device, "'cpu' or 'auto' here: torch sees no CUDA device")
    if device == "cpu":    # Triton kernels run in its interpreter; read when triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench.bandwidth import measure_copy_bandwidth
    from worker_service.device_info import describe_device

    shape, iters, warmup = _validate(args, device)
    backends = _available_backends(device) if args.all_backends else [args.backend]
    copy_bps = measure_copy_bandwidth(device)
    elem = torch.empty((), dtype=getattr(torch, shape.dtype)).element_size()
    kv_bytes, other_bytes = shape.bytes_per_call(elem)
    total = kv_bytes + other_bytes
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {now} · decode attention · {device} ({describe_device(device).name})",
             f"shape: {shape.describe()}, one layer",
             f"bytes per call: {total / 1e6:.4g} MB (KV read {kv_bytes / 1e6:.4g} MB + Q, O and "
             f"new K/V {other_bytes / 1e6:.4g} MB)",
             f"measured copy bandwidth: {copy_bps / 1e9:.4g} GB/s (bytes read + written)"]
    ok = True
    for name in backends:
        block_size = args.block_size   # flash-attn wants a multiple of 256: --all-backends
        if name == "flash_attn" and args.all_backends and block_size % FLASH_BLOCK_SIZE:
            block_size = FLASH_BLOCK_SIZE
        r = time_backend(name, shape, block_size, device, iters, warmup, args.seed,
                         args.decode_splits if name == "triton" else None)
        ok &= r.check_ok
        bps = total / r.median_s
        lines.append(
            f"{r.label}: {r.median_s * 1e3:.4g} ms median of {len(r.seconds)} calls "
            f"(min {min(r.seconds) * 1e3:.4g}, max {max(r.seconds) * 1e3:.4g}), "
            f"{bps / 1e9:.4g} GB/s = {bps / copy_bps:.3g} of copy bandwidth; check vs float32 "
            f"reference {r.check_error:.2e} ({'ok' if r.check_ok else 'FAILED'})")
    lines += [f"note: {n}" for n in args.note]
    return lines, ok


def time_backend(name: str, shape: Shape, block_size: int, device: str, iters: int,
                 warmup: int, seed: int, decode_splits: int | None = None) -> BackendRun:
    """Build one decode batch for `name`, check its output, then time its forward."""
    from kernels.attention.torch_ref import attend_one, gather_kv

    backend = _make_backend(name, shape, block_size, device, decode_splits)
    q, k, v, cache, meta = make_decode_batch(shape, block_size, device, seed)
    scale = shape.head_dim ** -0.5

    def call():
        return backend.forward(q, k, v, cache, meta, scale)

    out = call().float()
    num = min(CHECK_REQS, shape.num_reqs)
    ref = torch.stack([attend_one(q[i:i + 1], *gather_kv(cache, meta.block_table[i],
                                                         shape.context), scale)[0]
                       for i in range(num)])
    err = float((out[:num] - ref).norm() / ref.norm())
    seconds = _time_calls(call, device, iters, warmup)
    label = f"{name} (block {block_size}{_path_note(backend, shape, decode_splits)})"
    return BackendRun(label, seconds, err, err <= CHECK_TOL[shape.dtype])


def make_decode_batch(shape: Shape, block_size: int, device: str, seed: int):
    """(query, key, value, kv_cache, AttentionMetadata) of a pure-decode batch: every request
    has `context` tokens after this step; its blocks are a random, unshared set of the cache."""
    from kernels.attention.backend import AttentionMetadata

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    n, ctx = shape.num_reqs, shape.context
    blocks_per_req = -(-ctx // block_size)
    num_blocks = n * blocks_per_req
    table = torch.randperm(num_blocks, device=device, generator=gen).view(n, blocks_per_req)
    table = table.to(torch.int32)
    cache = torch.randn((2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
                        dtype=dtype, device=device, generator=gen)

    def rand(heads: int):
        return torch.randn((n, heads, shape.head_dim), dtype=dtype, device=device, generator=gen)

    q, k, v = rand(shape.num_heads), rand(shape.num_kv_heads), rand(shape.num_kv_heads)
    last = ctx - 1          # this step's token: position ctx - 1, written by slot mapping
    slots = table[:, last // block_size].to(torch.int64) * block_size + last % block_size
    qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((n,), ctx, dtype=torch.int32, device=device)
    meta = AttentionMetadata(num_reqs=n, num_actual_tokens=n, max_query_len=1, max_seq_len=ctx,
                             query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
                             slot_mapping=slots, query_start_loc_cpu=qsl.cpu(),
                             seq_lens_cpu=seq_lens.cpu())
    return q, k, v, cache, meta


def _time_calls(call, device: str, iters: int, warmup: int) -> list[float]:
    """Seconds per call: CUDA events around each call on CUDA, perf_counter on CPU."""
    for _ in range(warmup):
        call()
    if device != "cuda":
        seconds = []
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - t0)
        return seconds
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def _path_note(backend, shape: Shape, decode_splits: int | None) -> str:
    """Which path the backend takes for this batch, where it has more than one."""
    if decode_splits:
        return f", {decode_splits} splits"
    if backend.name != "torch":
        return ""
    from kernels.attention.torch_batched import padded_bytes
    need = padded_bytes(shape.num_reqs, 1, shape.context, shape.num_heads, shape.num_kv_heads,
                        shape.head_dim)
    if backend.batched and need <= backend.max_padded_bytes:
        return ", batched SDPA"
    return (f", per-request loop: batched scratch {need / 1e6:.4g} MB > "
            f"{backend.max_padded_bytes / 1e6:.4g} MB")


def _make_backend(name: str, shape: Shape, block_size: int, device: str,
                  decode_splits: int | None):
    from kernels.attention.selector import CacheLayout, get_attention_backend

    if name == "triton" and decode_splits is not None:
        from kernels.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(decode_splits=decode_splits)
    layout = CacheLayout(block_size, shape.head_dim, getattr(torch, shape.dtype))
    try:
        return get_attention_backend(name, device, layout)
    except (ValueError, ImportError) as e:
        raise ParamError("backend", name, f"usable here ({e})") from e


def _available_backends(device: str) -> list[str]:
    """Backends that can run on `device` in this environment, in BACKENDS order."""
    import importlib.util

    names = []
    if importlib.util.find_spec("triton") is not None:
        names.append("triton")
    if device == "cuda":
        try:
            from kernels.attention.flash_attn_backend import import_flash_attn
            import_flash_attn()
            names.append("flash_attn")
        except ImportError:
            pass
    return names + ["torch"]


def _validate(args: argparse.Namespace, device: str) -> tuple[Shape, int, int]:
    """(shape, timed calls, warm-up calls) with the device's defaults filled in."""
    d_reqs, d_ctx, d_iters, d_warm = SIZE_DEFAULTS["cuda" if device == "cuda" else "cpu"]
    shape = Shape(pick(args.num_reqs, d_reqs), pick(args.context, d_ctx), args.num_heads,
                  args.num_kv_heads, args.head_dim, args.dtype)
    iters, warmup = pick(args.iters, d_iters), pick(args.warmup, d_warm)
    for field, value in (("num_reqs", shape.num_reqs), ("context", shape.context),
                         ("num_heads", shape.num_heads), ("num_kv_heads", shape.num_kv_heads),
                         ("head_dim", shape.head_dim), ("iters", iters)):
        if value < 1:
            raise ParamError(field, value, ">= 1")
    if warmup < 0:
        raise ParamError("warmup", warmup, ">= 0")
    if shape.num_heads % shape.num_kv_heads:
        raise ParamError("num_heads", shape.num_heads,
                         f"a multiple of num_kv_heads={shape.num_kv_heads}")
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        raise ParamError("block_size", args.block_size, "a power of two >= 1")
    if args.decode_splits is not None and args.decode_splits < 1:
        raise ParamError("decode_splits", args.decode_splits, ">= 1")
    return shape, iters, warmup


def pick(value: int | None, default: int) -> int:
    """value, or default when it was not given."""
    return default if value is None else value


if __name__ == "__main__":
    sys.exit(main())
