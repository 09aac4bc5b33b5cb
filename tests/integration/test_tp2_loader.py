"""TP=2 against TP=1 on the same weights: two gloo rank processes load their slices and prefill
through a paged cache; every rank's logits equal the single rank's. Its own file in the
integration lane: it spawns processes and takes about 5 s on 2 quiet cores."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchAttentionBackend
from tests.support.grpc_harness import free_port
from worker_service.models.loader import allocate_kv_caches, load_model
from worker_service.models.tiny_model import make_tiny_model
from worker_service.parallel_state import TPGroup, single_rank_group

BACKEND = TorchAttentionBackend()


def load(path, tp=None):
    return load_model(path, tp or single_rank_group(), BACKEND, "cpu")


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """All-position logits of one request prefilled through a fresh paged cache."""
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


def tp_worker(rank: int, port: int, paths: list[str], out_dir: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        ids = torch.arange(19) * 7 % 500
        for i, path in enumerate(paths):
            logits = prefill_logits(load(path, tp=TPGroup(rank=rank, world_size=2)), ids)
            torch.save(logits, f"{out_dir}/logits_{i}_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    """Two gloo ranks: split kv heads (qwen3, odd padded vocab), replicated kv head with
    o_proj/MLP biases (llama), q/k/v bias (qwen2)."""
    paths = [make_tiny_model(tmp_path / "q3", arch="qwen3", vocab_size=513),
             make_tiny_model(tmp_path / "ll", arch="llama", num_key_value_heads=1,
                             attention_bias=True, mlp_bias=True),
             make_tiny_model(tmp_path / "q2", arch="qwen2")]
    mp.spawn(tp_worker, args=(free_port(), [str(p) for p in paths], str(tmp_path)), nprocs=2)
    ids = torch.arange(19) * 7 % 500
    for i, path in enumerate(paths):
        expected = prefill_logits(load(path), ids)
        for rank in range(2):
            got = torch.load(tmp_path / f"logits_{i}_{rank}.pt")
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
