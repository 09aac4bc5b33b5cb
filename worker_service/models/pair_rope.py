"""Checkpoints whose rope rotates interleaved pairs (GLM, GLM-4, Cohere, Cohere2), served on
our rotate-half ropes.

transformers' GLM and Cohere rotate dims (2i, 2i + 1) of each head by frequency i (their
rotate_half reads x[..., 0::2] and x[..., 1::2]); every rope here (torch, the C++ CPU rope, the
Triton rope) rotates dims (i, i + r/2), r the rotary dim. Attention reads q and k only through
q . k, which one permutation of the head dims applied to both leaves unchanged, so the q and k
projection rows (their biases, Cohere's per-head q/k norm weights) are reordered at load,
within each head (values untouched, so the attention output is the same):

    checkpoint dim   0   1   2   3  ...  r-2   r-1  |  r ... D-1
    our dim          0  r/2  1  r/2+1 ... r/2-1 r-1 |  r ... D-1

our dims [0, r/2) hold the checkpoint's even dims, [r/2, r) its odd ones, the rest (partial
rotary: GLM's r = D/2) stay. The rotate-half rope over transformers' frequency table then
rotates exactly the pairs transformers rotates. A LoRA adapter's q/k lora_B rows go through
the same split_checkpoint_tensor (lora/layers.py), so they are reordered alike.
"""
from __future__ import annotations

from typing import Any

import torch

from worker_service.layers.rotary import RopeSettings
from worker_service.layers.sharding import read_all

# checkpoint tensors whose rows (per head) are q or k dims
PERMUTED = (".self_attn.q_proj.weight", ".self_attn.q_proj.bias", ".self_attn.k_proj.weight",
            ".self_attn.k_proj.bias", ".self_attn.q_norm.weight", ".self_attn.k_norm.weight")


def halves_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Our dim j holds the checkpoint's dim order[j] (the table in the module docstring)."""
    return torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                      torch.arange(rotary_dim, head_dim)))


def pairs_to_halves(rows: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """q/k rows [heads * D, ...] (a projection's weight or bias) reordered within each head."""
    heads = rows.reshape(-1, head_dim, *rows.shape[1:])
    return heads[:, halves_order(head_dim, rotary_dim)].reshape(rows.shape).contiguous()


class PairRopeCheckpoint:
    """Mixin for a LlamaForCausalLM subclass whose checkpoint rotates interleaved pairs: its
    q/k tensors are reordered as they load (models/loader.py's split_checkpoint_tensor hook).
    List it before the model class."""

    pair_rotary_dim: int = 0      # set by the model once its rope is known

    def set_pair_rotary_dim(self, hf_config: dict) -> None:
        """The rotary dim the reordering uses: the rope's (GLM's partial rotary included)."""
        self.pair_rotary_dim = RopeSettings.from_hf_config(hf_config).rotary_dim(
            self.args.head_dim)

    def split_checkpoint_tensor(self, name: str, tensor: Any) -> list[tuple[str, Any]] | None:
        """q/k tensors reordered (a per-head norm weight [heads, D] flattened first); None
        for the others."""
        if not name.endswith(PERMUTED):
            return None
        whole = read_all(tensor)
        rows = whole if "_proj." in name else whole.reshape(-1)
        halves = pairs_to_halves(rows, self.args.head_dim, self.pair_rotary_dim)
        return [(name, halves.reshape(whole.shape))]
