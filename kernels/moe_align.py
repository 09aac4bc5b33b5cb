"""Routing alignment for the fused MoE kernels, on the device and without a host sync.

    align_by_expert(ids [T, k], num_experts, block_m) -> MoeAlignment

The (token, slot) pairs of a batch, numbered s = token * k + slot (s < T * k), are grouped by
expert and each expert's group is padded to a multiple of block_m, so that every block of
block_m rows of `sorted_slots` belongs to one expert (`block_expert`). Padding rows hold the
sentinel T * k, past every real slot. Only the first `num_blocks` blocks hold slots; the others
are padding through and through (their expert is -1), and the GEMM programs given them exit at
once.

Every buffer's size is the worst case for (T, k, E, block_m), never the routing's: a CUDA graph
captured for T tokens replays for any routing of T tokens, and nothing reads a count back to the
host. The worst case: expert e with c_e pairs takes ceil(c_e / block_m) blocks, which is at most
c_e and at most (c_e + block_m - 1) / block_m, so the sum over the (at most min(E, T * k))
experts that have pairs is at most min(T * k, (T * k + min(E, T * k) * (block_m - 1)) / block_m).

Torch ops, about twenty small launches (scatter-add counts, cumsums, each pair's rank within its
expert, a scatter, a searchsorted): bincount and repeat_interleave are avoided (on CUDA both size
their output from the data, a sync). The ranks come from a one-hot cumsum for batches up to
ONE_HOT_MAX_ELEMENTS pairs x experts (16 MB of int32: 32768 pairs at 128 experts, i.e. 4096
tokens at top-8, past any captured decode batch), else from a stable argsort. vLLM and SGLang do this in one custom kernel (per-expert counts with a prefix
sum in shared memory); a Triton port of that is the next step if these launches show in a
profile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ONE_HOT_MAX_ELEMENTS = 1 << 22    # pairs x experts up to which ranks come from a one-hot cumsum


@dataclass(frozen=True)
class MoeAlignment:
    """sorted_slots int32 [max_blocks * block_m]: slot ids grouped by expert, padding = T * k;
    block_expert int32 [max_blocks]: each block's expert, -1 past the valid blocks;
    num_blocks int32 [1]: how many blocks hold slots (on the device)."""

    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks any routing of num_pairs (token, slot) pairs over num_experts can need."""
    used = min(num_experts, num_pairs)
    return min(num_pairs, (num_pairs + used * (block_m - 1)) // block_m)


def ranks_within_expert(flat: torch.Tensor, counts: torch.Tensor, num_experts: int):
    """(pair, its expert, its rank among that expert's pairs in slot order), in some order of
    the pairs. Small batches (every captured decode size): a one-hot [pairs, E] cumsum, no sort
    (CUB's sorts are not all capturable in CUDA graphs); larger ones: a stable argsort."""
    num_pairs = flat.numel()
    pairs = torch.arange(num_pairs, device=flat.device)
    if num_pairs * num_experts <= ONE_HOT_MAX_ELEMENTS:
        one_hot = (flat[:, None] == torch.arange(num_experts, device=flat.device)).int()
        rank = one_hot.cumsum(0, dtype=torch.int32).gather(1, flat[:, None])[:, 0] - 1
        return pairs, flat, rank.long()
    order = torch.argsort(flat, stable=True)              # pairs by expert, slot order within
    expert = flat[order]
    first_pair = torch.cumsum(counts, 0) - counts         # e's first pair in expert order
    return order, expert, pairs - first_pair[expert]


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """ids [T, k] (expert of each token's slot, any integer dtype, values in [0, E))."""
    num_pairs = ids.numel()
    device = ids.device
    n_blocks = max_blocks(num_pairs, num_experts, block_m)
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)                   # inclusive: expert e's blocks end here
    first_row = (block_end - blocks) * block_m            # e's first row in sorted_slots
    pair, expert, rank = ranks_within_expert(flat, counts, num_experts)
    sorted_slots = torch.full((n_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, first_row[expert] + rank, pair.int())
    block_ids = torch.arange(n_blocks, device=device)
    owner = torch.searchsorted(block_end, block_ids, right=True)   # E past the valid blocks
    block_expert = torch.where(owner < num_experts, owner, -1).int()
    num_blocks = block_end[-1:].int()
    return MoeAlignment(sorted_slots, block_expert, num_blocks, block_m)
