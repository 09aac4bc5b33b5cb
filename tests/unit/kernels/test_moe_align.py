"""The device-side routing alignment of the fused MoE path (kernels/moe_align.py; torch ops, so
it runs as it is on CPU): every (token, slot) pair lands exactly once, each block holds one
expert's pairs, padding is marked, and the buffers' sizes depend on the shapes only; by the
one-hot ranks (small batches) and by the argsort (large ones) alike."""
from __future__ import annotations

import itertools

import pytest
import torch

from kernels import moe_align
from kernels.moe_align import align_by_expert, max_blocks

E = 8


def routing(num_tokens: int, top_k: int, seed: int) -> torch.Tensor:
    """Distinct experts per token, as a top-k router gives."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(num_tokens)])


def check_invariants(ids: torch.Tensor, block_m: int) -> None:
    num_pairs = ids.numel()
    flat = ids.reshape(-1)
    a = align_by_expert(ids, E, block_m)
    n = int(a.num_blocks.item())
    slots, experts = a.sorted_slots.long(), a.block_expert.long()
    # exactly the blocks each expert needs, all inside the worst-case buffers
    need = sum(-(-int((flat == e).sum()) // block_m) for e in range(E))
    assert n == need <= a.max_blocks == max_blocks(num_pairs, E, block_m)
    assert slots.shape == (a.max_blocks * block_m,)
    # every real pair exactly once, all inside the valid blocks; the rest is the sentinel
    real = slots[slots < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert (slots[n * block_m:] == num_pairs).all()
    assert ((slots < num_pairs) | (slots == num_pairs)).all()
    # each valid block belongs to one expert, which every pair in it was routed to
    for b in range(n):
        rows = slots[b * block_m:(b + 1) * block_m]
        rows = rows[rows < num_pairs]
        assert rows.numel() > 0                       # no block of padding only
        assert (flat[rows] == experts[b]).all()
    assert (experts[n:] == -1).all()
    # experts in ascending order, and within an expert the pairs in slot order
    assert experts[:n].tolist() == sorted(experts[:n].tolist())
    for e in range(E):
        mine = real[flat[real] == e]
        assert mine.tolist() == sorted(mine.tolist())


@pytest.fixture(params=["one-hot", "argsort"])
def rank_path(request, monkeypatch):
    """Both ways of ranking pairs within their expert (the argsort one past the size limit)."""
    if request.param == "argsort":
        monkeypatch.setattr(moe_align, "ONE_HOT_MAX_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("num_tokens,top_k,block_m",
                         list(itertools.product([1, 3, 37], [1, 2, 4], [1, 4, 16])))
def test_every_pair_once_in_single_expert_blocks(num_tokens, top_k, block_m, rank_path):
    check_invariants(routing(num_tokens, top_k, seed=num_tokens * 10 + top_k), block_m)


@pytest.mark.parametrize("block_m", [4, 16])
def test_all_tokens_on_one_expert_and_idle_experts(block_m, rank_path):
    check_invariants(torch.full((37, 1), 5), block_m)           # 7 experts without tokens
    check_invariants(torch.tensor([[7, 0]] * 20), block_m)     # two experts, the last and first


def test_both_rank_paths_give_the_same_alignment(monkeypatch):
    ids = routing(37, 4, seed=9)
    one_hot = align_by_expert(ids, E, 4)
    monkeypatch.setattr(moe_align, "ONE_HOT_MAX_ELEMENTS", 0)
    sorted_ = align_by_expert(ids, E, 4)
    assert torch.equal(one_hot.sorted_slots, sorted_.sorted_slots)
    assert torch.equal(one_hot.block_expert, sorted_.block_expert)
    assert moe_align.ONE_HOT_MAX_ELEMENTS == 0


def test_the_worst_case_is_reached():
    """max_blocks is tight: every expert one pair more than a whole block (37 x 2 pairs over
    8 experts, blocks of 4 -> 9 or 10 pairs each, 3 blocks each = 24 = the bound's
    (74 + 8 * 3) // 4)."""
    ids = (torch.arange(74) % E).view(37, 2)
    a = align_by_expert(ids, E, 4)
    assert int(a.num_blocks.item()) == a.max_blocks == 24
    assert max_blocks(3, E, 16) == 3            # fewer pairs than experts: one block a pair


def test_sizes_depend_on_shapes_only():
    """Two routings of the same batch shape give buffers of the same shapes and dtypes, so a
    CUDA graph captured for one replays the other."""
    spread, one = routing(37, 2, seed=1), torch.tensor([[3, 4]] * 37)
    a, b = align_by_expert(spread, E, 16), align_by_expert(one, E, 16)
    for name in ("sorted_slots", "block_expert", "num_blocks"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x.shape, x.dtype) == (y.shape, y.dtype) and x.dtype == torch.int32
    assert int(a.num_blocks.item()) > int(b.num_blocks.item()) == 6     # 3 + 3 blocks


def test_empty_batch():
    a = align_by_expert(torch.zeros(0, 2, dtype=torch.long), E, 16)
    assert a.max_blocks == 0 and a.sorted_slots.numel() == 0
    assert int(a.num_blocks.item()) == 0
