"""The engine flags of `deltaserve scheduler` and `deltaserve serve`, and their EngineOptions."""
from __future__ import annotations

import argparse

from scheduler_service.api.server import EngineOptions


def add_engine_flags(p: argparse.ArgumentParser) -> None:
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


def engine_options(args):
    """The scheduler's EngineOptions from the engine flags."""
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
