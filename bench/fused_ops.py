"""Norm and rope microbenchmark: the model's torch ops against the fused Triton kernels.

    python -m bench.fused_ops                       # CUDA: T = 256 (decode) and 8192 (prefill)
    python -m bench.fused_ops --device cpu --num-tokens 4 --hidden 64 --num-heads 4 \\
        --num-kv-heads 2 --head-dim 16              # the CPU smoke run (Triton interpreter)

Defaults: qwen3-0.6b's shapes (hidden 1024, 16 query heads, 8 KV heads, head_dim 128, bf16,
rope theta 1e6 over 40960 positions). Per token count T, four ops, each timed eagerly:

    op            torch (worker_service/layers)        fused (kernels/)      floor bytes per call
    rms_norm      RMSNorm(x)                           fused_norm.rms_norm   2 T H e + H e
    add+rms_norm  RMSNorm(x, residual)                 same, residual form   4 T H e + H e
    head norm     RMSNorm(q) over [T, Hq, D] (qwen3)   same                  2 T Hq D e + D e
    rope          RotaryEmbedding(pos, q, k)           fused_rope (in place) 2 T (Hq+Hk) D e
                                                                             + 2 T (D/2) 4

(H hidden, e bytes per element; q and k are strided views of one qkv row, as in the model.)
Before any timing every fused output is checked against the torch op on the same inputs
(relative L2 error, ‖fused − torch‖ / ‖torch‖); a failed check skips the timing and exits 1.
Timing: warm-up calls, then CUDA events around each call, median (CPU: time.perf_counter).
GB/s is floor bytes over the median time; at small T the inputs may stay in L2. speedup is
torch time / fused time (> 1: fused is faster).
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import torch

from engine_common.request.params import ParamError

from bench.kernel_timing import resolve_kernel_bench_device, time_calls
from bench.report import add_report_flags, append_block, git_commit

CHECK_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.5e-2}   # relative L2 error
# (token counts, timed calls, warm-up calls) when not given, per device type
SIZE_DEFAULTS = {"cuda": ("256,8192", 200, 20), "cpu": ("4", 3, 1)}
ROPE_THETA = 1_000_000.0
MAX_POSITION = 40960
EPS = 1e-6


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.fused_ops`."""
    p = argparse.ArgumentParser(prog="python -m bench.fused_ops",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--num-tokens", help="comma-separated token counts T (CUDA 256,8192; CPU 4)")
    add("--hidden", type=int, default=1024, help="hidden size (the norms' width)")
    add("--num-heads", type=int, default=16, help="query heads")
    add("--num-kv-heads", type=int, default=8, help="key/value heads")
    add("--head-dim", type=int, default=128, help="dimension of one head")
    add("--dtype", choices=sorted(CHECK_TOL), default="bfloat16", help="activation dtype")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if any")
    add("--iters", type=int, help="timed calls per op (CUDA 200, CPU 3)")
    add("--warmup", type=int, help="untimed calls first (CUDA 20, CPU 1)")
    add("--check-tol", type=float, help="relative L2 error allowed (default by dtype: "
        + ", ".join(f"{k} {v}" for k, v in CHECK_TOL.items()) + ")")
    add("--seed", type=int, default=0, help="seed of the random inputs")
    add_report_flags(p)
    return p


@dataclass(frozen=True)
class Shape:
    num_tokens: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.num_heads} query heads, {self.num_kv_heads} KV "
                f"heads, head_dim {self.head_dim}, {self.dtype}")


@dataclass(frozen=True)
class OpCase:
    """One op at one shape: both implementations as zero-argument calls on fixed inputs."""

    name: str
    num_tokens: int
    torch_call: Callable[[], tuple]
    fused_call: Callable[[], tuple]
    floor_bytes: int


@dataclass(frozen=True)
class OpTiming:
    case: OpCase
    torch_s: float              # median seconds per call
    fused_s: float

    @property
    def speedup(self) -> float:
        return self.torch_s / self.fused_s


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.fused_ops ARGS`: check, time, print, append to the results file."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    command = shlex.join(["python", "-m", "bench.fused_ops", *argv])
    try:
        head, body, ok = run(args)
    except ParamError as e:
        print(f"fused_ops: error: {e}", file=sys.stderr)
        return 2
    for line in head[1:] + [""] + body:
        print(line)
    block = "\n".join([head[0], "", f"- commit: `{git_commit()}`", f"- command: `{command}`"]
                      + [f"- {line}" for line in head[1:]] + [""] + body) + "\n"
    append_block(args.results_file, block)
    print(f"appended to {args.results_file}")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> tuple[list[str], list[str], bool]:
    """Check every op, then time them. Returns (title and summary lines, the table or the
    failed checks, all checks ok)."""
    device = resolve_kernel_bench_device(args.device)
    from bench.bandwidth import measure_copy_bandwidth
    from worker_service.device_info import describe_device

    shapes, iters, warmup = _validate(args, device)
    tol = CHECK_TOL[args.dtype] if args.check_tol is None else args.check_tol
    cases = [c for s in shapes for c in make_cases(s, device, args.seed)]
    checks = [(c, check_error(c)) for c in cases]
    ok = all(err <= tol for _, err in checks)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [f"## {now} · fused norm + rope · {device} ({describe_device(device).name})",
            f"shape: {shapes[0].describe()}; T = "
            + ", ".join(str(s.num_tokens) for s in shapes),
            f"checks (fused vs torch, relative L2 error <= {tol:g}): "
            + "; ".join(f"{c.name} T={c.num_tokens} {err:.2e} "
                        f"({'ok' if err <= tol else 'FAILED'})" for c, err in checks)]
    head += [f"note: {n}" for n in args.note]
    if not ok:
        return head, ["verification FAILED: nothing timed"], False
    copy_bps = measure_copy_bandwidth(device)
    head.append(f"measured copy bandwidth: {copy_bps / 1e9:.4g} GB/s (bytes read + written); "
                f"median of {iters} calls after {warmup} warm-up")
    timings = [time_case(c, device, iters, warmup) for c in cases]
    return head, format_table(timings, copy_bps), True


def make_cases(shape: Shape, device: str, seed: int) -> list[OpCase]:
    """The four ops at one token count, on fresh random inputs."""
    from kernels.fused_norm import rms_norm
    from kernels.fused_rope import fused_rope
    from worker_service.layers.norm import RMSNorm
    from worker_service.layers.rotary import RopeSettings, RotaryEmbedding

    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device=device).manual_seed(seed + shape.num_tokens)
    t, h, d = shape.num_tokens, shape.hidden, shape.head_dim
    hq, hk = shape.num_heads, shape.num_kv_heads
    elem = torch.empty((), dtype=dtype).element_size()

    def rand(*size, scale=1.0):
        return scale * torch.randn(size, dtype=dtype, device=device, generator=gen)

    norm = RMSNorm(h, EPS, dtype).to(device)
    head_norm = RMSNorm(d, EPS, dtype).to(device)
    with torch.no_grad():
        norm.weight.copy_(1 + rand(h, scale=0.1))
        head_norm.weight.copy_(1 + rand(d, scale=0.1))
    x, res = rand(t, h, scale=3.0), rand(t, h)
    qkv = rand(t, (hq + 2 * hk) * d)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    rope = RotaryEmbedding(d, MAX_POSITION, RopeSettings("default", ROPE_THETA)).to(device)
    pos = torch.randint(0, MAX_POSITION, (t,), device=device, generator=gen)
    cos, sin = rope.cos_cache, rope.sin_cache
    return [
        OpCase("rms_norm", t, lambda: (norm(x),), lambda: (rms_norm(x, norm.weight, EPS),),
               2 * t * h * elem + h * elem),
        OpCase("add+rms_norm", t, lambda: norm(x, res),
               lambda: rms_norm(x, norm.weight, EPS, res), 4 * t * h * elem + h * elem),
        OpCase("head norm", t, lambda: (head_norm(q),),
               lambda: (rms_norm(q, head_norm.weight, EPS),), 2 * t * hq * d * elem + d * elem),
        OpCase("rope", t, lambda: rope(pos, q, k), lambda: fused_rope(pos, q, k, cos, sin),
               2 * t * (hq + hk) * d * elem + 2 * t * (d // 2) * 4),
    ]


def check_error(case: OpCase) -> float:
    """Largest relative L2 error of the fused outputs against the torch ones. Runs the torch op
    first: the fused rope then rotates q and k in place, from the same inputs."""
    with torch.no_grad():
        want = [w.float() for w in case.torch_call()]
        got = [g.float() for g in case.fused_call()]
    return max(float((g - w).norm() / w.norm().clamp_min(1e-30)) for g, w in zip(got, want))


def time_case(case: OpCase, device: str, iters: int, warmup: int) -> OpTiming:
    with torch.no_grad():
        torch_s = statistics.median(time_calls(case.torch_call, device, iters, warmup))
        fused_s = statistics.median(time_calls(case.fused_call, device, iters, warmup))
    return OpTiming(case, torch_s, fused_s)


def format_table(timings: list[OpTiming], copy_bps: float) -> list[str]:
    """A Markdown table: one row per op and token count."""
    rows = ["| op | T | torch ms | fused ms | speedup (torch/fused) | torch GB/s | fused GB/s "
            "| fused / copy bandwidth |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in timings:
        b = r.case.floor_bytes
        rows.append(f"| {r.case.name} | {r.case.num_tokens} | {r.torch_s * 1e3:.4g} | "
                    f"{r.fused_s * 1e3:.4g} | {r.speedup:.3g}x | {b / r.torch_s / 1e9:.4g} | "
                    f"{b / r.fused_s / 1e9:.4g} | {b / r.fused_s / copy_bps:.3g} |")
    return rows


def _validate(args: argparse.Namespace, device: str) -> tuple[list[Shape], int, int]:
    """(one shape per token count, timed calls, warm-up calls), device defaults filled in."""
    d_tokens, d_iters, d_warm = SIZE_DEFAULTS["cuda" if device == "cuda" else "cpu"]
    spec = args.num_tokens or d_tokens
    try:
        counts = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ParamError("num_tokens", spec, "comma-separated integers >= 1") from None
    iters = d_iters if args.iters is None else args.iters
    warmup = d_warm if args.warmup is None else args.warmup
    for field, value in (("hidden", args.hidden), ("num_heads", args.num_heads),
                         ("num_kv_heads", args.num_kv_heads), ("iters", iters),
                         *(("num_tokens", n) for n in counts or [0])):
        if value < 1:
            raise ParamError(field, value, ">= 1")
    if warmup < 0:
        raise ParamError("warmup", warmup, ">= 0")
    if args.check_tol is not None and not args.check_tol >= 0:
        raise ParamError("check_tol", args.check_tol, ">= 0")
    if args.head_dim % 2 or not 2 <= args.head_dim <= 256:
        raise ParamError("head_dim", args.head_dim, "even, in [2, 256]")
    return [Shape(n, args.hidden, args.num_heads, args.num_kv_heads, args.head_dim, args.dtype)
            for n in counts], iters, warmup


if __name__ == "__main__":
    sys.exit(main())
