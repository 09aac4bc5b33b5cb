"""The cost of the gRPC path: one workload through the in-process engine, then through a real
worker and scheduler process as concurrent streaming Generate calls, in the same run.

    python -m bench.grpc_overhead --preset tiny --num-seqs 32 --min-len 16 --max-len 64

Both paths get the same engine settings, a short untimed warm-up, and the whole workload at once
(every request submitted before the first token). Greedy with ignore_eos, so both must produce
the same token ids; the run exits 1 when they do not. Prints each path's output tokens, wall time
and tok/s, the ratio gRPC / in-process, and the mean time to first token; appends the same
figures to bench/results.md. With --async-scheduling the gRPC path runs a second time with two
steps in flight, and the ratio async / one step at a time is printed too.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import shlex
import signal
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone

from engine_common.request.params import ParamError

from bench.grpc_paths import EngineSettings, PathRun, run_grpc, run_in_process
from bench.report import add_report_flags, append_block, git_commit
from bench.services import ServiceError
from bench.workload import (Workload, add_model_and_workload_flags, model_and_workload,
                            warmup_workload, workload_shape)

WARMUP_SEQS = 4
WARMUP_OUTPUT_LEN = 8


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m bench.grpc_overhead`."""
    p = argparse.ArgumentParser(prog="python -m bench.grpc_overhead",
                                description=__doc__.splitlines()[0])
    add_model_and_workload_flags(p, "tiny", num_seqs=32, min_len=16, max_len=64,
                                 workload_title="workload (greedy, ignore_eos)")
    e = p.add_argument_group("engine (the same on both paths)")
    e.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    e.add_argument("--dtype", default="float32", help="default: float32")
    e.add_argument("--attention-backend", default="auto", help="default: auto")
    e.add_argument("--max-num-seqs", type=int, default=256, help="default: 256")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="default: 2048")
    e.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV-cache budget in GiB (default: 1)")
    e.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads in this process and the worker (default: "
                        "torch's)")
    e.add_argument("--async-scheduling", action="store_true",
                   help="also run the gRPC path with --async-scheduling and compare")
    add_report_flags(p)
    return p


@dataclass(frozen=True)
class OverheadResult:
    """Both paths' runs of one workload, and how they were configured."""

    model: str
    device: str
    device_name: str
    engine: str
    workload: str
    in_process: PathRun
    grpc: PathRun
    notes: tuple[str, ...]
    grpc_async: PathRun | None = None   # the gRPC path again with --async-scheduling

    @property
    def ratio(self) -> float:
        """gRPC throughput over in-process throughput (1.0: no cost)."""
        return self.grpc.tokens_per_s / self.in_process.tokens_per_s

    def mismatch(self) -> str | None:
        """Where the two paths' greedy token ids first differ; None when identical."""
        pairs = zip(self.in_process.token_ids, self.grpc.token_ids)
        bad = [i for i, (a, b) in enumerate(pairs) if a != b]
        if not bad:
            return None
        a, b = self.in_process.token_ids[bad[0]], self.grpc.token_ids[bad[0]]
        pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return (f"{len(bad)} of {len(self.in_process.token_ids)} requests differ; first: "
                f"request {bad[0]} at output position {pos}")

    def async_mismatch(self) -> str | None:
        """Requests whose async-scheduled gRPC tokens differ from the in-process ones."""
        if self.grpc_async is None:
            return None
        pairs = zip(self.in_process.token_ids, self.grpc_async.token_ids)
        bad = [i for i, (a, b) in enumerate(pairs) if a != b]
        return f"{len(bad)} requests differ; first: request {bad[0]}" if bad else None


def main(argv: list[str] | None = None) -> int:
    """Run both paths, print the figures, append them to the results file. Exit status: 0, 1
    when the token ids differ or a service failed, 2 for a bad flag."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        with _sigterm_as_exit():
            result = run(args)
    except ParamError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    except ServiceError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 1
    for line in format_lines(result):
        print(line)
    command = shlex.join(["python", "-m", "bench.grpc_overhead", *argv])
    append_block(args.results_file, format_block(result, command))
    print(f"appended to {args.results_file}")
    return 0 if result.mismatch() is None and result.async_mismatch() is None else 1


def run(args: argparse.Namespace) -> OverheadResult:
    """The in-process engine, then (with it freed) the services, on one workload."""
    from worker_service.device_info import describe_device

    settings, model_dir, workload, vocab_size = _prepare(args)
    warmup = _warmup_workload(args, workload, vocab_size)
    in_process, engine = run_in_process(model_dir, settings, workload, warmup)
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="deltaserve-bench-") as log_dir:
        grpc_run = run_grpc(model_dir, settings, workload, warmup, log_dir)
        grpc_async = None
        if args.async_scheduling:
            grpc_async = run_grpc(model_dir, dataclasses.replace(settings, async_scheduling=True),
                                  workload, warmup, log_dir)
    return OverheadResult(
        model=args.model or args.preset, device=args.device,
        device_name=describe_device(args.device).name, engine=engine,
        workload=_describe_workload(workload, args), in_process=in_process, grpc=grpc_run,
        notes=tuple(args.note), grpc_async=grpc_async)


def _prepare(args) -> tuple[EngineSettings, str, Workload, int]:
    """Settings, model directory, workload and vocabulary size from the flags."""
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ParamError("cpu_threads", args.cpu_threads, ">= 1")
    if args.kv_cache_gib <= 0:
        raise ParamError("kv_cache_gib", args.kv_cache_gib, "> 0")
    model_dir, workload, vocab_size = model_and_workload(args, args.preset, args.device)
    settings = EngineSettings(
        device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=workload_shape(args).max_total_len, kv_cache_gib=args.kv_cache_gib,
        cpu_threads=args.cpu_threads)
    return settings, model_dir, workload, vocab_size


def _warmup_workload(args, workload: Workload, vocab_size: int) -> Workload:
    """A few short requests with other prompts (no prefix-cache hits on the timed ones)."""
    return warmup_workload(workload, vocab_size, WARMUP_SEQS, WARMUP_OUTPUT_LEN)


def _describe_workload(w: Workload, args) -> str:
    return (f"{workload_shape(args).describe()} (uniform), seed {w.seed}, greedy, ignore_eos, "
            f"token-id prompts; "
            f"{w.num_prompt_tokens} prompt tokens, {w.num_output_tokens} output tokens asked")


def format_lines(r: OverheadResult) -> list[str]:
    """The figures, one per line (Markdown list items without the leading dash)."""
    ip, gr = r.in_process, r.grpc
    mismatch = r.mismatch()
    extra_ms = (gr.wall_s - ip.wall_s) / ip.num_steps * 1e3 if ip.num_steps else 0.0
    lines = [f"engine: {r.engine}", f"workload: {r.workload}",
             f"in-process: {ip.output_tokens} output tokens in {ip.wall_s:.3f} s = "
             f"{ip.tokens_per_s:.1f} tok/s, mean time to first token "
             f"{ip.mean_ttft_s * 1e3:.1f} ms, {ip.num_steps} engine steps",
             f"gRPC: {gr.output_tokens} output tokens in {gr.wall_s:.3f} s = "
             f"{gr.tokens_per_s:.1f} tok/s, mean time to first token "
             f"{gr.mean_ttft_s * 1e3:.1f} ms over {len(gr.token_ids)} streams",
             f"gRPC / in-process throughput: {r.ratio:.3f}x "
             f"({extra_ms:+.2f} ms of wall time per in-process engine step)",
             "greedy token ids identical: " + ("yes" if mismatch is None else f"NO ({mismatch})")]
    ga = r.grpc_async
    if ga is not None:
        bad = r.async_mismatch()
        lines += [f"gRPC, async scheduling: {ga.output_tokens} output tokens in {ga.wall_s:.3f} s "
                  f"= {ga.tokens_per_s:.1f} tok/s, mean time to first token "
                  f"{ga.mean_ttft_s * 1e3:.1f} ms",
                  f"gRPC async / one step at a time: {ga.tokens_per_s / gr.tokens_per_s:.3f}x",
                  "async greedy token ids identical: " + ("yes" if bad is None else f"NO ({bad})")]
    return lines + [f"note: {n}" for n in r.notes]


def format_block(r: OverheadResult, command: str) -> str:
    """The Markdown block appended to the results file."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [f"## {now} · gRPC overhead · {r.model} · {r.device} ({r.device_name})", "",
            f"- commit: `{git_commit()}`", f"- command: `{command}`"]
    return "\n".join(head + [f"- {line}" for line in format_lines(r)]) + "\n"


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM raises SystemExit (as Ctrl-C raises KeyboardInterrupt), so every `finally` runs
    and the services are stopped. Only in the main thread, where signals can be handled."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
