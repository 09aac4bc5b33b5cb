"""RSS of one CPU worker's model after load (weights + the CPU kernels' panels and packs).

    PYTHONPATH=$PWD python -m bench.cpu_linear_rss MODEL_DIR DTYPE

Loads MODEL_DIR as the worker does (loader.load_model on "cpu": load, prepare the CPU
kernels, trim the heap) in this process and prints its resident set and the bytes the
prepared linears hold (parameters still resident, panels, packs), and for an MoE model its
packed routed experts' (dense size, parameters still resident, panels). Run it once per
checkout to compare (docs/cpu_performance.md).
"""
from __future__ import annotations

import sys

import torch


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def main(model_dir: str, dtype: str) -> None:
    from kernels.attention.torch_ref import TorchAttentionBackend
    from worker_service.models.loader import load_model
    from worker_service.parallel_state import single_rank_group

    torch.set_num_threads(1)
    base = _rss_mib()
    model = load_model(model_dir, single_rank_group(), TorchAttentionBackend(), "cpu", dtype)
    linears = [m for m in model.modules() if getattr(m, "cpu_linear", None) is not None]
    dense = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    kept = sum(m.weight.untyped_storage().nbytes() for m in linears)
    print(f"{model_dir} {dtype}: RSS {_rss_mib():.0f} MiB ({_rss_mib() - base:.0f} MiB over "
          f"torch's import); {len(linears)} linears, {dense / 2**20:.0f} MiB dense, "
          f"{kept / 2**20:.0f} MiB of their parameters resident")
    experts = [m for m in model.modules() if getattr(m, "cpu_experts", None) is not None]
    if experts:
        params = [p for m in experts for p in (m.w13_weight, m.w2_weight)]
        dense = sum(p.numel() * p.element_size() for p in params)
        kept = sum(p.untyped_storage().nbytes() for p in params)
        panels = sum(m.cpu_experts.nbytes for m in experts)
        print(f"  {len(experts)} packed expert layers, {dense / 2**20:.0f} MiB dense, "
              f"{kept / 2**20:.0f} MiB of their parameters resident, {panels / 2**20:.0f} MiB "
              f"of panels")


if __name__ == "__main__":
    main(*sys.argv[1:])
