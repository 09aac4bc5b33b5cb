"""Tensor-parallel linear layers. Weights are [out_features_per_rank, in_features_per_rank].

    column-parallel:  W = [W_0; W_1; ...] split by output rows; rank r computes y_r = x W_r^T,
                      outputs stay sharded (the next row-parallel layer consumes them).
    row-parallel:     W = [W_0 | W_1 | ...] split by input columns; rank r computes x_r W_r^T,
                      then an all-reduce sums the partial outputs; the bias is added once, after.

Packed layers (qkv_proj, gate_up_proj) hold several checkpoint tensors stacked along the output
dim; their weight loader takes a shard_id saying which piece it was handed. A GPTQ / AWQ piece
loaded natively on the CPU is kept packed (cpu_gemm.CpuGemm.take_packed) at the same rows.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker_service.layers.cpu_gemm import CpuGemm
from worker_service.layers.sharding import copy_checked, divide, new_param, read_all, read_rows
from worker_service.parallel_state import TPGroup


class ColumnParallelLinear(CpuGemm, nn.Module):
    """y = x W^T + b with W's output rows split across ranks; output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype | None = None, shard_ids: tuple | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, tp.world_size, "output_size")
        shape = (self.output_size_per_rank, input_size)
        self.weight = new_param(shape, dtype, self.weight_loader, shard_ids)
        if bias:
            self.bias = new_param(shape[:1], dtype, self.weight_loader, shard_ids)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """Copy this rank's block of output rows (weight or bias)."""
        size = self.output_size_per_rank
        start = self.tp.rank * size
        if self.take_packed(param, loaded, (start, start + size), None):
            return
        copy_checked(param.data, read_rows(loaded, 0, self.tp.rank * size, size), "column")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stacked (gate_up_proj).

    Per rank the output is [piece_0 rows of this rank | piece_1 rows of this rank | ...];
    shard_id is the piece index.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPGroup,
                 dtype: torch.dtype | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp, dtype,
                         shard_ids=tuple(range(len(output_sizes))))

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id not in range(len(self.output_sizes)):
            raise ValueError(f"shard_id={shard_id!r} is invalid: must be in "
                             f"[0, {len(self.output_sizes)})")
        world = self.tp.world_size
        size = divide(self.output_sizes[shard_id], world, f"output_sizes[{shard_id}]")
        offset = sum(self.output_sizes[:shard_id]) // world
        start = self.tp.rank * size
        if self.take_packed(param, loaded, (start, start + size), None, offset):
            return
        src = read_rows(loaded, 0, self.tp.rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), src, f"merged piece {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections stacked: per rank [q heads | k heads | v heads] x head_dim rows.

    Query heads are split evenly across ranks. Key/value heads are split when there are at least
    as many as ranks; otherwise they are replicated and rank r keeps kv head
    r * num_kv_heads // world_size (the head its query heads attend to).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, tp: TPGroup, dtype: torch.dtype | None = None) -> None:
        world = tp.world_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, world, "num_attention_heads")
        if num_kv_heads >= world:
            self.num_kv_heads = divide(num_kv_heads, world, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            divide(world, num_kv_heads, "world_size / num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // world
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out_total = (self.q_size + 2 * self.kv_size) * world   # per-rank size times ranks
        super().__init__(hidden_size, out_total, bias, tp, dtype, shard_ids=("q", "k", "v"))

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"shard_id={shard_id!r} is invalid: must be 'q', 'k' or 'v'")
        if self.take_packed(param, loaded, (start, start + size), None, offset):
            return
        src = read_rows(loaded, 0, start, size)
        copy_checked(param.data.narrow(0, offset, size), src, f"qkv piece {shard_id}")


class RowParallelLinear(CpuGemm, nn.Module):
    """y = all_reduce(x_r W_r^T) + b with W's input columns split across ranks.

    The input is this rank's shard of the features (the output of a column-parallel layer).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.input_size_per_rank = divide(input_size, tp.world_size, "input_size")
        shape = (output_size, self.input_size_per_rank)
        self.weight = new_param(shape, dtype, self.weight_loader)
        if bias:
            self.bias = new_param((output_size,), dtype, self.bias_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """Copy this rank's block of input columns."""
        size = self.input_size_per_rank
        start = self.tp.rank * size
        if self.take_packed(param, loaded, None, (start, start + size)):
            return
        copy_checked(param.data, read_rows(loaded, 1, self.tp.rank * size, size), "row")

    def bias_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """The bias is replicated: every rank keeps all of it and adds it after the reduce."""
        copy_checked(param.data, read_all(loaded), "row bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias
