"""The tensor-parallel group a model shard talks to: its rank, the group size, two collectives.

With world_size 1 every collective is the identity, so a single-device model pays nothing.
The group object is passed explicitly to every layer; there is no global parallel state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its tensor-parallel group.

    `process_group` is a torch.distributed ProcessGroup (None means the default group); it is
    only consulted when world_size > 1.
    """

    rank: int
    world_size: int
    process_group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} is invalid: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is invalid: must be in [0, {self.world_size})")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` across the group (in place when world_size > 1); returns it."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist
        dist.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in rank order."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=dim)


def single_rank_group() -> TPGroup:
    """The trivial group of one rank: no communication at all."""
    return TPGroup(rank=0, world_size=1)
