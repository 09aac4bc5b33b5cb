"""Offline throughput of the in-process engine on nano-vllm's workload, optionally against
transformers `generate()` in the same process and run.

    python -m bench.throughput --preset qwen3-0.6b --vs-transformers
    python -m bench.throughput --preset qwen3-0.6b --fused-ops     # Triton norm, rope, silu
    python -m bench.throughput --preset tiny --device cpu --num-seqs 64 --min-len 16 --max-len 64

Prints output tok/s, time per decode step, and the bytes a decode step reads (weights + KV) per
second against the device's measured copy bandwidth; appends the same figures to bench/results.md.
"""
from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from pathlib import Path

from engine_common.request.params import ParamError, SamplingParams, StoppingParams

from bench.report import (BenchResult, add_report_flags, append_block, format_block,
                          format_lines)
from bench.step_timer import StepTimer
from bench.workload import (Workload, add_fused_ops_flag, add_model_and_workload_flags,
                            model_and_workload, warmup_workload, workload_shape)

DEFAULT_HF_BATCH_SIZES = "1,8,32,64,128,256"
WARMUP_SEQS = 8
WARMUP_OUTPUT_LEN = 16


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The benchmark's flags, added to `p` (e.g. a `deltaserve bench` subparser) or a new one."""
    if p is None:
        p = argparse.ArgumentParser(prog="python -m bench.throughput",
                                    description=__doc__.splitlines()[0])
    w = add_model_and_workload_flags(p, None, num_seqs=256, min_len=100, max_len=1024)
    w.add_argument("--temperature", type=float, default=0.0, help="default: 0 (greedy)")
    e = p.add_argument_group("engine")
    e.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available (default: auto)")
    e.add_argument("--dtype", default="auto", help="bfloat16, float16, float32 or auto")
    e.add_argument("--attention-backend", default="auto",
                   help="torch, triton, flash_attn or auto (default: auto)")
    e.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV-cache budget in GiB (default: 1 GiB on CPU; on CUDA a profiled share "
                        "of the GPU, see --gpu-memory-utilization)")
    e.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on CUDA without --kv-cache-gib: the fraction of the GPU the engine may "
                        "use in all, KV cache sized from a profiled warm-up (default: 0.9)")
    e.add_argument("--max-num-seqs", type=int, default=256, help="default: 256")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: the engine's")
    e.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV-cache block (default: the engine's, 16)")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument("--async-scheduling", action="store_true", default=None,
                   help="two steps in flight: the scheduler plans step t+1 while the runner "
                        "thread runs step t (default: on for CUDA, off for CPU)")
    e.add_argument("--sync-scheduling", dest="async_scheduling", action="store_false",
                   help="one step in flight, even on CUDA")
    add_fused_ops_flag(e)
    e.add_argument("--triton-launch", default=None,
                   help="other Triton attention launch choices, name=value,... (an experiment: "
                        "bench/launch_override.py)")
    e.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's; 1 avoids stalls on a "
                        "busy shared CPU)")
    e.add_argument("--warmup", action="store_true",
                   help="a short untimed run first (both engines)")
    h = p.add_argument_group("transformers comparison")
    h.add_argument("--vs-transformers", action="store_true",
                   help="also time transformers generate() on the same prompts")
    h.add_argument("--hf-batch-sizes", default=DEFAULT_HF_BATCH_SIZES,
                   help=f"batch sizes to try (default: {DEFAULT_HF_BATCH_SIZES})")
    h.add_argument("--hf-time-budget", type=float, default=30.0,
                   help="seconds per batch size, at least one batch (default: 30)")
    add_report_flags(p)
    return p


def add_command(sub: argparse._SubParsersAction) -> None:
    """`deltaserve bench`: pyproject declares this in the deltaserve.commands entry point group,
    which deltaserve/cli.py reads, so the CLI needs no import of bench."""
    p = sub.add_parser("bench", help="offline throughput of the in-process engine "
                                     "(appends bench/results.md)")
    build_parser(p).set_defaults(run_command=run_and_report)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.throughput ARGS`: run, print, append to the results file."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return run_and_report(args, shlex.join(["python", "-m", "bench.throughput", *argv]))


def run_and_report(args: argparse.Namespace, command: str | None = None) -> int:
    """Run the benchmark, print the figures and append them, with `command` (default: this
    process's command line), to the results file. Returns the exit status."""
    try:
        result = run(args)
    except ParamError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    for line in format_lines(result):
        print(line)
    command = command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])
    append_block(args.results_file, format_block(result, command))
    print(f"appended to {args.results_file}")
    return 0


def run(args: argparse.Namespace) -> BenchResult:
    """The whole benchmark: our engine, then (optionally) transformers, then the copy ceiling."""
    from worker_service.device_info import resolve_device
    from worker_service.device_info import describe_device

    device = resolve_device(args.device)
    if args.fused_ops and device == "cpu":   # Triton reads it when triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.cpu_threads is not None:
        if args.cpu_threads < 1:
            raise ParamError("cpu_threads", args.cpu_threads, ">= 1")
        import torch

        torch.set_num_threads(args.cpu_threads)
    model_dir, workload, _ = model_and_workload(args, args.preset or "qwen3-0.6b", device)
    ours, torch_dtype = _run_ours(args, model_dir, device, workload)
    gc.collect()
    _empty_device_cache(device)
    hf = None
    if args.vs_transformers:
        from bench.hf_baseline import run_transformers

        sizes = [int(s) for s in args.hf_batch_sizes.split(",") if s.strip()]
        hf = run_transformers(model_dir, workload, device, torch_dtype, sizes,
                              args.hf_time_budget, args.warmup)
    from bench.bandwidth import measure_copy_bandwidth

    return BenchResult(model=args.model or args.preset or "qwen3-0.6b", device=device,
                       device_name=describe_device(device).name,
                       workload=_describe_workload(workload, args),
                       copy_bytes_per_s=measure_copy_bandwidth(device), hf=hf, **ours)


def _llm_kwargs(args, device: str, max_model_len: int) -> tuple[dict, list[str]]:
    """LLM keyword arguments from the flags, and notes on flags this engine does not have."""
    from engine_common.configuration.config import SchedulerConfig
    from worker_service.config import RunnerConfig

    kwargs = dict(device=device, dtype=args.dtype, attention_backend=args.attention_backend,
                  max_num_seqs=args.max_num_seqs, max_model_len=max_model_len)
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    if args.kv_cache_gib is not None:
        kwargs["kv_cache_bytes"] = int(args.kv_cache_gib * (1 << 30))
    notes = list(args.note)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.fused_ops:
        kwargs["fused_ops"] = True
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    known = set(RunnerConfig.__dataclass_fields__) | set(SchedulerConfig.__dataclass_fields__)
    kwargs = {k: v for k, v in kwargs.items() if k in known}
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kwargs, notes


def apply_experiments(llm, args) -> list[str]:
    """The bench-only engine experiment the flags ask for (--triton-launch), applied to a
    started engine; returns its notes."""
    notes = []
    if args.triton_launch:
        from bench.launch_override import apply_launch, parse_launch

        apply_launch(llm, parse_launch(args.triton_launch))
        notes.append(f"triton launch: {args.triton_launch}")
    return notes


def _run_ours(args, model_dir: str, device: str, workload: Workload):
    """Time our engine on the workload. Returns (BenchResult fields, the model's torch dtype);
    the engine is gone when this returns."""
    from deltaserve.llm import LLM

    from bench.bandwidth import kv_bytes_per_token, weight_read_bytes
    from bench.jit_compiles import JitCompiles

    kwargs, notes = _llm_kwargs(args, device, workload_shape(args).max_total_len)
    llm = LLM(model_dir, **kwargs)
    notes += apply_experiments(llm, args)
    if args.warmup:
        warm = warmup_workload(workload, llm.model_info.vocab_size, WARMUP_SEQS,
                               WARMUP_OUTPUT_LEN)
        _generate(llm, warm, args)
    with StepTimer(llm.engine) as timer, JitCompiles() as compiles:
        _sync(device)
        start = time.perf_counter()
        completions = _generate(llm, workload, args)
        _sync(device)
        wall = time.perf_counter() - start
    output_tokens = sum(len(c.token_ids) for c in completions)
    if output_tokens != workload.num_output_tokens:
        notes.append(f"engine produced {output_tokens} tokens, workload asked "
                     f"{workload.num_output_tokens}")
    for name, seconds, sig in compiles.events:       # what met a new specialization, in full
        print(f"triton compile in the timed run: {seconds:.2f} s {sig}")
    runner = llm.runner
    return dict(engine=_describe_engine(llm), output_tokens=output_tokens, wall_s=wall,
                jit_compiles=compiles.describe(),
                steps=timer.summary(), weight_bytes=weight_read_bytes(runner.model),
                kv_bytes_per_token=kv_bytes_per_token(runner),
                notes=tuple(notes)), runner.model_dtype


def _generate(llm, workload: Workload, args):
    n = workload.num_seqs
    sampling = [SamplingParams(temperature=args.temperature, seed=args.seed + i)
                for i in range(n)]
    stopping = [StoppingParams(max_tokens=m, ignore_eos=True) for m in workload.output_lens]
    return llm.generate(workload.prompts, sampling, stopping)


def _describe_engine(llm) -> str:
    runner, sched = llm.runner, llm.scheduler
    dtype = str(runner.model_dtype).removeprefix("torch.")
    graphs = ", decode CUDA graphs" if runner.graph_runner is not None else ", eager"
    fused = ", fused Triton norm + rope + silu" if getattr(runner.model, "fused_ops", False) else ""
    fused += ", async scheduling" if sched.config.async_scheduling else ""
    return (f"{runner.attention_backend_name} attention, {dtype}{graphs}{fused}, "
            f"{sched.num_total_blocks} KV blocks of {sched.config.block_size}, "
            f"max_num_seqs {sched.config.max_num_seqs}, "
            f"max_num_batched_tokens {sched.config.max_num_batched_tokens}")


def _describe_workload(w: Workload, args) -> str:
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    named = f"{args.workload}: " if args.workload else ""
    return (f"{named}{workload_shape(args).describe()} (uniform), seed {w.seed}, {sampling}, "
            f"ignore_eos; {w.num_prompt_tokens} prompt tokens, {w.num_output_tokens} output "
            f"tokens asked")


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _empty_device_cache(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
