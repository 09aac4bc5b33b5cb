"""Decode attention microbenchmark: one pure-decode batch per backend, against the copy ceiling.

Times only the attention backend's forward on the batch, and sets the bytes it must move against
the device's measured copy bandwidth.

    python -m bench.attention_bandwidth                      # 256 requests x 1024, triton
    python -m bench.attention_bandwidth --all-backends
    python -m bench.attention_bandwidth --device cpu --num-reqs 4 --context 64 --backend torch
    python -m bench.attention_bandwidth --device cpu --backend cpu --dtype bfloat16   # the C++ kernel
    python -m bench.attention_bandwidth --unified            # split-KV decode vs one kernel
    python -m bench.attention_bandwidth --mixed              # two-kernel dispatch vs one kernel
    python -m bench.attention_bandwidth --sweep --unified    # launch choices of both designs

Defaults: qwen3-0.6b's attention (16 query heads, 8 KV heads, head_dim 128, bf16), one layer.
The cache holds exactly the blocks the batch uses, shuffled into random block tables, filled
with random values (never zeros); at the CUDA default it is 1 GiB, far above any L2.

Triton designs (bench/attention_sweep.py; kernels/attention/triton_launch.py names them):
--unified times the decode batch through the split-KV decode kernel and through the varlen
kernel alone, then prints `split/unified` (time ratio: below 1, two kernels win). --mixed
builds num_reqs - num_prefills decodes at `context` plus num_prefills prefill chunks of `chunk`
tokens after `context` cached ones, and times per-request dispatch (two launches) against the
varlen kernel alone. --sweep times a grid of launch choices on the decode batch.

Bytes per call (the floor; MB/GB are powers of ten), summed over requests:

    KV read      seq_len * num_kv_heads * head_dim * 2 (K and V) * elem
    Q read       query_len * num_heads * head_dim * elem
    O write      query_len * num_heads * head_dim * elem
    K/V write    query_len * num_kv_heads * head_dim * 2 * elem   (forward first writes this
                 step's keys/values by slot mapping; a decode's query_len is 1)

Block-table reads (4 bytes per block, under 0.1% at the default) are left out. Copy bandwidth
is bench/bandwidth.py's: bytes read plus bytes written by a large device copy. Timing: warm-up
calls, then CUDA events around each call, median (CPU: time.perf_counter). Before timing, a few
requests' output (the first and last CHECK_REQS // 2) is checked against the float32 reference
(‖out − ref‖ / ‖ref‖); a failed check makes the run exit 1.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime, timezone

import torch

from engine_common.request.params import ParamError

from bench.attention_batch import (CHECK_TOL, BackendRun, Session, Shape,  # noqa: F401
                                   make_batch, make_decode_batch)
from bench.kernel_timing import resolve_kernel_bench_device
from bench.report import add_report_flags, append_block, git_commit

BACKENDS = ("triton", "flash_attn", "cpu", "torch")
FLASH_BLOCK_SIZE = 256      # flash-attn's paged kernels need blocks of a multiple of 256
# (num_reqs, context, iterations, warm-up) when not given, per device type
SIZE_DEFAULTS = {"cuda": (256, 1024, 50, 5), "cpu": (8, 128, 5, 1)}
MIXED_DEFAULTS = {"cuda": (8, 512), "cpu": (1, 16)}   # (prefill chunks, tokens per chunk)


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
    add("--dtype", choices=sorted(CHECK_TOL), default="bfloat16",
        help="cache and query dtype")
    add("--backend", choices=BACKENDS, default="triton", help="attention backend")
    add("--all-backends", action="store_true", help="every backend available here, in turn")
    add("--decode-splits", type=int, help="triton: fixed split count (none: its heuristic)")
    add("--unified", action="store_true",
        help="triton: also time the varlen kernel alone (one-kernel design) and the ratio")
    add("--mixed", action="store_true",
        help="triton: a mixed batch, two-kernel dispatch vs the varlen kernel alone")
    add("--num-prefills", type=int, help="--mixed: prefill chunks among num_reqs (CUDA 8, CPU 1)")
    add("--chunk", type=int, help="--mixed: tokens per prefill chunk (CUDA 512, CPU 16)")
    add("--sweep", action="store_true",
        help="triton: time a grid of launch choices (with --unified, the varlen kernel's too)")
    add("--sweep-points", type=int, help="--sweep: run at most this many points (none: all)")
    add("--sweep-budget", type=float, help="--sweep: start no point after this many seconds")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if any")
    add("--iters", type=int, help="timed calls (CUDA 50, CPU 5)")
    add("--warmup", type=int, help="untimed calls first (CUDA 5, CPU 1)")
    add("--seed", type=int, default=0, help="seed of the random batch")
    add_report_flags(p)
    return p


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
    head = [lines[0], "", f"- commit: `{git_commit()}`", f"- command: `{command}`"]
    append_block(args.results_file, "\n".join(head + to_markdown(lines[1:])) + "\n")
    print(f"appended to {args.results_file}")
    return 0 if ok else 1


def to_markdown(lines: list[str]) -> list[str]:
    """List items, except table rows ("|..."), which stay raw with a blank line around."""
    out: list[str] = []
    for line in lines:
        is_row = line.startswith("|")
        was_row = bool(out) and out[-1].startswith("|")
        if is_row != was_row and out:
            out.append("")
        out.append(line if is_row else f"- {line}")
    return out


def run(args: argparse.Namespace) -> tuple[list[str], bool]:
    """The requested backends or Triton design runs. Returns (the block's lines, title first;
    every check ok)."""
    device = resolve_kernel_bench_device(args.device)
    from bench.bandwidth import measure_copy_bandwidth
    from worker_service.device_info import describe_device

    shape, iters, warmup = _validate(args, device)
    session = Session(shape, device, iters, warmup, args.seed, measure_copy_bandwidth(device))
    kv_bytes, other_bytes = shape.bytes_per_call(session.elem)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kind = "mixed-batch attention" if args.mixed else "decode attention"
    kind += " launch sweep" if args.sweep else ""
    lines = [f"## {now} · {kind} · {device} ({describe_device(device).name})",
             f"shape: {shape.describe()}, one layer",
             f"bytes per call: {session.total_bytes / 1e6:.4g} MB (KV read {kv_bytes / 1e6:.4g} "
             f"MB + Q, O and new K/V {other_bytes / 1e6:.4g} MB)",
             f"measured copy bandwidth: {session.copy_bps / 1e9:.4g} GB/s "
             "(bytes read + written)"]
    if args.unified or args.mixed or args.sweep:
        from bench.attention_sweep import run_triton_designs
        more, ok = run_triton_designs(args, session)
    else:
        more, ok = _run_backends(args, session)
    return lines + more + [f"note: {n}" for n in args.note], ok


def _run_backends(args: argparse.Namespace, session: Session) -> tuple[list[str], bool]:
    """One line per requested backend, each on its own batch (block sizes may differ)."""
    backends = _available_backends(session.device) if args.all_backends else [args.backend]
    lines, ok = [], True
    for name in backends:
        block_size = args.block_size   # flash-attn wants a multiple of 256: --all-backends
        if name == "flash_attn" and args.all_backends and block_size % FLASH_BLOCK_SIZE:
            block_size = FLASH_BLOCK_SIZE
        splits = args.decode_splits if name == "triton" else None
        backend = _make_backend(name, session.shape, block_size, session.device, splits)
        batch = session.batch(block_size)
        label = f"{name} (block {block_size}{_path_note(backend, batch)})"
        r = session.measure(label, backend, batch)
        ok &= r.check_ok
        lines.append(session.line(r))
    return lines, ok


def _path_note(backend, batch) -> str:
    """Which path the backend takes for this batch, where it has more than one."""
    shape, meta = batch.shape, batch.tensors[4]
    if backend.name == "triton":
        splits = backend.num_splits(meta, shape.num_kv_heads, batch.tensors[3].device)
        how = "fixed" if backend.decode_splits else "auto"
        return f", {how}: {splits} split{'s' if splits > 1 else ''}"
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
    else:
        from kernels.attention import cpu_paged
        if cpu_paged.available():
            names.append("cpu")
    return names + ["torch"]


def _validate(args: argparse.Namespace, device: str) -> tuple[Shape, int, int]:
    """(shape, timed calls, warm-up calls) with the device's defaults filled in."""
    kind = "cuda" if device == "cuda" else "cpu"
    d_reqs, d_ctx, d_iters, d_warm = SIZE_DEFAULTS[kind]
    d_prefills, d_chunk = MIXED_DEFAULTS[kind] if args.mixed else (0, 0)
    shape = Shape(pick(args.num_reqs, d_reqs), pick(args.context, d_ctx), args.num_heads,
                  args.num_kv_heads, args.head_dim, args.dtype,
                  pick(args.num_prefills, d_prefills), pick(args.chunk, d_chunk))
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
    _validate_modes(args, shape)
    return shape, iters, warmup


def _validate_modes(args: argparse.Namespace, shape: Shape) -> None:
    """The Triton design flags: which combinations and values make sense."""
    if (args.unified or args.mixed or args.sweep) and (
            args.all_backends or args.backend != "triton"):
        raise ParamError("backend", "all" if args.all_backends else args.backend,
                         "triton, without --all-backends, for --unified, --mixed or --sweep")
    if args.mixed and args.sweep:
        raise ParamError("sweep", True, "without --mixed (the sweep times the decode batch)")
    if args.sweep and args.decode_splits is not None:
        raise ParamError("decode_splits", args.decode_splits, "unset with --sweep (it sweeps "
                         "splits)")
    for flag, value, needs in (("num_prefills", args.num_prefills, args.mixed),
                               ("chunk", args.chunk, args.mixed),
                               ("sweep_points", args.sweep_points, args.sweep),
                               ("sweep_budget", args.sweep_budget, args.sweep)):
        if value is not None and not needs:
            raise ParamError(flag, value, "given only with --" + ("mixed" if flag in (
                "num_prefills", "chunk") else "sweep"))
    if args.mixed and not 1 <= shape.num_prefills <= shape.num_reqs:
        raise ParamError("num_prefills", shape.num_prefills, f"in [1, num_reqs={shape.num_reqs}]")
    if args.mixed and shape.chunk < 2:
        raise ParamError("chunk", shape.chunk, ">= 2 (a one-token chunk is a decode)")
    if args.sweep_points is not None and args.sweep_points < 1:
        raise ParamError("sweep_points", args.sweep_points, ">= 1")
    if args.sweep_budget is not None and args.sweep_budget < 0:
        raise ParamError("sweep_budget", args.sweep_budget, ">= 0")


def pick(value: int | None, default: int) -> int:
    """value, or default when it was not given."""
    return default if value is None else value


if __name__ == "__main__":
    sys.exit(main())
