"""Helpers every tensor-parallel layer shares: shard arithmetic and weight-loader plumbing.

A weight loader has the signature `loader(param, loaded, shard_id=None)`. `loaded` is either a
torch.Tensor or a lazy safetensors slice (`safe_open(...).get_slice(name)`); both support
`loaded[a:b]` / `loaded[:, a:b]`, so a loader reads only the rows/columns its rank keeps.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

WeightLoader = Callable[..., None]


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming `what` when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size "
                         f"{denominator}")
    return numerator // denominator


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def read_rows(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded[start:start+size] along dim 0 or 1, materialised as a tensor."""
    if dim == 0:
        return loaded[start:start + size]
    if dim == 1:
        return loaded[:, start:start + size]
    raise ValueError(f"dim={dim} is invalid: must be 0 or 1")


def read_all(loaded: Any) -> torch.Tensor:
    """The whole tensor (a replicated parameter)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """dst.copy_(src) with a shape check that names the parameter."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} does not match "
                         f"parameter shape {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    """Replicated parameter: every rank copies the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"shard_id={shard_id!r} given for an unsharded parameter")
    copy_checked(param.data, read_all(loaded), "replicated")


def new_param(shape: tuple[int, ...], dtype: torch.dtype | None, loader: WeightLoader,
              shard_ids: tuple | None = None) -> nn.Parameter:
    """An uninitialised, frozen parameter carrying its weight loader.

    `shard_ids` lists the checkpoint pieces a packed parameter needs (e.g. ("q", "k", "v")),
    so the model loader can tell when one is missing.
    """
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    param.shard_ids = shard_ids
    return param
