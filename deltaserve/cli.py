"""The `deltaserve` command: worker, scheduler, serve (both on this machine) and generate.

Heavy modules are imported inside each subcommand: `deltaserve scheduler` and `deltaserve
generate` never import torch, so they run where torch is not installed.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

DEFAULT_TARGET = "localhost:50051"
DEFAULT_WORKER_LISTEN = "127.0.0.1:50052"


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests in the running batch at once (default: 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens (prefill chunks + decodes) in one step (default: 2048)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens of one request (default: the model's "
                        "max_position_embeddings)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV-cache block, a power of two (default: 16)")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="queued requests before new ones get RESOURCE_EXHAUSTED (default: 1024)")
    g.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV-cache size per device in GiB (default: the worker's, 1 GiB, "
                        "unless --gpu-memory-utilization is given)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: fraction of each GPU's memory the worker may use in all "
                        "(weights, activations, KV cache), in (0, 1]; the KV cache gets the "
                        "rest (default: unset)")
    g.add_argument("--dtype", default="auto",
                   help="bfloat16, float16, float32 or auto: the model config's (default: auto)")
    g.add_argument("--attention-backend", default="auto",
                   help="torch, triton, flash_attn or auto: the best available (default: auto)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse KV blocks of shared prompt prefixes")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly: no CUDA graphs (default: graphs on CUDA with "
                        "the triton or flash_attn backend)")
    g.add_argument("--max-graph-batch", type=int, default=512,
                   help="largest decode batch captured as a CUDA graph: 1, 2, 4, 8, then steps "
                        "of 16 up to this (default: 512)")
    g.add_argument("--async-scheduling", action="store_true",
                   help="keep two steps in flight: schedule step t+1 while the workers run "
                        "step t (default: one step at a time)")
    g.add_argument("--fused-ops", action="store_true",
                   help="fused Triton RMSNorm and rotary embedding (CUDA; off by default until "
                        "GPU measurements show a gain)")
    g.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds open streams may finish after SIGTERM/SIGINT (default: 10)")


def _add_device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model runs; auto: cuda when available (default: auto)")
    p.add_argument("--local-ranks", type=int, default=1,
                   help="rank processes (devices) of this worker; the tensor-parallel size is "
                        "nodes x local ranks (default: 1)")


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-rank", type=int, default=0,
                   help="this worker's index among the --nodes workers; node 0 holds the output "
                        "rank and must be first in the scheduler's --workers (default: 0)")
    p.add_argument("--nodes", type=int, default=1,
                   help="worker services (nodes) in the tensor-parallel group (default: 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("worker", help="run a worker service (owns a device and the model)")
    p.add_argument("--listen", required=True, help="HOST:PORT to serve the Worker protocol on")
    _add_device_flags(p)
    _add_node_flags(p)

    p = sub.add_parser("scheduler", help="run the scheduler service (public API; no torch)")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--workers", required=True, help="worker addresses, HOST:PORT[,HOST:PORT...]")
    p.add_argument("--listen", default="0.0.0.0:50051",
                   help="HOST:PORT for the public API (default: 0.0.0.0:50051)")
    p.add_argument("--dist-port", type=int, default=29500,
                   help="with several workers: the torch.distributed rendezvous port on node "
                        "0's host (default: 29500)")
    p.add_argument("--verify-symmetry", action="store_true",
                   help="every rank digests its sampled ids each step; a mismatch fails the step")
    _add_engine_flags(p)

    p = sub.add_parser("serve", help="one worker and the scheduler on this machine")
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory (default: a tiny model with RANDOM "
                        "weights, created once in the cache directory)")
    p.add_argument("--listen", default=DEFAULT_TARGET,
                   help=f"HOST:PORT for the public API (default: {DEFAULT_TARGET})")
    p.add_argument("--worker-listen", default=DEFAULT_WORKER_LISTEN,
                   help=f"HOST:PORT of the worker it starts (default: {DEFAULT_WORKER_LISTEN})")
    _add_device_flags(p)
    _add_engine_flags(p)

    p = sub.add_parser("generate", help="stream one completion from a running server")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"HOST:PORT of the scheduler (default: {DEFAULT_TARGET})")
    p.add_argument("--token-ids", default=None,
                   help="the prompt as comma-separated token ids instead of text")
    p.add_argument("--max-tokens", type=int, default=64, help="default: 64")
    p.add_argument("--min-tokens", type=int, default=0, help="default: 0")
    p.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None, help="default: the server's (1)")
    p.add_argument("--top-k", type=int, default=None, help="default: the server's (0: off)")
    p.add_argument("--min-p", type=float, default=None, help="default: the server's (0: off)")
    p.add_argument("--seed", type=int, default=None, help="default: the server draws one")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past eos")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")

    from bench import throughput as bench_throughput  # torch-free at import
    bench_throughput.build_parser(sub.add_parser(
        "bench", help="offline throughput of the in-process engine (appends bench/results.md)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `deltaserve` console script."""
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except CliError as e:
        print(f"deltaserve {args.command}: error: {e}", file=sys.stderr)
        return 2


class CliError(Exception):
    """A bad flag value or a failed start, reported in one line."""


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _cmd_worker(args) -> int:
    from worker_service.server import node_layout, run_worker

    try:
        node_layout(args.local_ranks, args.node_rank, args.nodes)
    except ValueError as e:
        raise CliError(str(e)) from None
    run_worker(args.listen, resolve_device(args.device), local_ranks=args.local_ranks,
               node_rank=args.node_rank, num_nodes=args.nodes)
    return 0


def engine_options(args):
    """The scheduler's EngineOptions from the engine flags."""
    from scheduler_service.server import EngineOptions

    kv_bytes = None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30))
    return EngineOptions(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size,
        max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_bytes=kv_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype, attention_backend=args.attention_backend,
        grace_period_s=args.grace_period, dist_port=getattr(args, "dist_port", 29500),
        verify_symmetry=getattr(args, "verify_symmetry", False),
        enforce_eager=args.enforce_eager, max_graph_batch=args.max_graph_batch,
        fused_ops=args.fused_ops, async_scheduling=args.async_scheduling)


def _cmd_scheduler(args) -> int:
    from scheduler_service.server import run_scheduler

    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    if not workers:
        raise CliError("--workers names no address")
    with _startup_errors():
        return run_scheduler(args.model, workers, args.listen, engine_options(args))


def _cmd_serve(args) -> int:
    if args.local_ranks < 1:
        raise CliError(f"--local-ranks={args.local_ranks}: must be >= 1")
    from deltaserve.embedded import serve

    with _startup_errors():
        return serve(args)


@contextlib.contextmanager
def _startup_errors():
    """Bad engine flags, a bad model directory or a port in use: one line, not a traceback."""
    from engine_common.model_dir import ModelDirError
    from engine_common.params import ParamError

    try:
        yield
    except (ParamError, ModelDirError, OSError) as e:
        raise CliError(str(e)) from None


def _cmd_generate(args) -> int:
    from deltaserve.client import generate

    return generate(args)


def _cmd_bench(args) -> int:
    from bench import throughput

    return throughput.run_and_report(args)


_COMMANDS = {"worker": _cmd_worker, "scheduler": _cmd_scheduler, "serve": _cmd_serve,
             "generate": _cmd_generate, "bench": _cmd_bench}

if __name__ == "__main__":
    sys.exit(main())
