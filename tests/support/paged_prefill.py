"""A model's prefill logits through a fresh paged cache, and the TP=2-over-gloo rank that
computes them on its slice: what the model-level tests (TP against one rank, MoE against
transformers) share."""
from __future__ import annotations

import torch

from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchAttentionBackend
from worker_service.models.loader import allocate_kv_caches, load_model
from worker_service.parallel_state import TPGroup, single_rank_group

BACKEND = TorchAttentionBackend()


def load(path, tp=None):
    return load_model(path, tp or single_rank_group(), BACKEND, "cpu")


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """All-position logits of one request prefilled through a fresh paged cache (blocks of 4,
    in reverse order)."""
    n, block_size = ids.shape[0], 4
    num_blocks = -(-n // block_size)
    caches = allocate_kv_caches(model, num_blocks, block_size, "cpu")
    table = torch.arange(num_blocks, dtype=torch.int32).flip(0)[None]
    pos = torch.arange(n)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    qsl, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    meta = AttentionMetadata(1, n, n, n, qsl, lens, table, slots, qsl, lens)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, caches, meta))


def tp_ids() -> torch.Tensor:
    return torch.arange(19) * 7 % 500


def tp_worker(rank: int, port: int, paths: list[str], out_dir: str,
              world_size: int = 2, backend: str = "torch") -> None:
    """One of world_size gloo ranks (torch.multiprocessing.spawn): each model's prefill logits
    on this rank's slice (attending on `backend`), saved as logits_<model>_<rank>.pt."""
    import torch.distributed as dist

    from kernels.attention.selector import get_attention_backend
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        for i, path in enumerate(paths):
            tp = TPGroup(rank=rank, world_size=world_size)
            model = load_model(path, tp, get_attention_backend(backend, "cpu"), "cpu")
            logits = prefill_logits(model, tp_ids())
            torch.save(logits, f"{out_dir}/logits_{i}_{rank}.pt")
    finally:
        dist.destroy_process_group()


def assert_tp2_matches_tp1(paths: list, out_dir, world_size: int = 2,
                           backend: str = "torch", atol: float = 1e-4) -> None:
    """Every rank's logits of every model (two ranks unless world_size says; the ranks attend on
    `backend`) equal the single rank's (on the torch backend)."""
    import torch.multiprocessing as mp

    from tests.support.grpc_harness import free_port

    mp.spawn(tp_worker, args=(free_port(), [str(p) for p in paths], str(out_dir), world_size,
                              backend), nprocs=world_size)
    for i, path in enumerate(paths):
        expected = prefill_logits(load(path), tp_ids())
        for rank in range(world_size):
            got = torch.load(f"{out_dir}/logits_{i}_{rank}.pt")
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=atol, rtol=0)
