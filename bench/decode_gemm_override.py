"""`--decode-gemm triton`: run the engine with kernels/decode_gemm.py's split-K GEMM for every
projection whose input is on CUDA with at most MAX_ROWS rows (decode steps), a bench-only
experiment (on CPU the wrapped layers keep their own path).

Each linear layer's matmul (worker_service/layers/cpu_gemm.py) is wrapped on the instance; the
LM head keeps its own path. Tile shapes are timed per (rows bucket, N, K) on first use, which
the decode graphs' eager run before each capture provides, so the graphs are captured again.
"""
from __future__ import annotations


def apply_decode_gemm(llm) -> str:
    """Wrap the model's linear layers on CUDA; capture the decode graphs again. Returns what
    was done: how many layers, and the tile chosen per (rows bucket, N, K) during capture."""
    from bench.launch_override import recapture_graphs
    from kernels.decode_gemm import MAX_ROWS, DecodeGemm
    from worker_service.layers.cpu_gemm import CpuGemm
    from worker_service.layers.embedding import ParallelLMHead

    gemm = DecodeGemm()
    wrapped = 0
    for module in llm.runner.model.modules():
        if not isinstance(module, CpuGemm) or isinstance(module, ParallelLMHead):
            continue
        inner = module.matmul

        def matmul(x, bias=None, _inner=inner, _weight=module.weight):
            if x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS:
                return gemm(x, _weight, bias)
            return _inner(x, bias)

        module.matmul = matmul
        wrapped += 1
    if not wrapped:
        raise ValueError("--decode-gemm triton found no linear layer to wrap")
    recapture_graphs(llm)
    chosen = ", ".join(f"{m}x{n}x{k}: {cfg}" for (m, n, k), cfg in sorted(gemm.chosen.items()))
    return f"split-K Triton in {wrapped} linear layers" + (f"; tiles {chosen}" if chosen else "")
