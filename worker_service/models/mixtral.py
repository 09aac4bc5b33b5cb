"""Mixtral (Mixtral-8x7B, 8x22B): Mistral's attention (its sliding window when the config sets
one) with every MLP a sparse block of top-k experts, as transformers' modeling_mixtral: the
router's softmax over all experts, the top k renormalised to sum to 1, each expert
w2(silu(w1 x) * w3 x) of width intermediate_size. No shared expert, no dense layer.

Checkpoint names (Hub and transformers 5's save_pretrained): `block_sparse_moe.gate` and
`block_sparse_moe.experts.<e>.w1/w2/w3`; they load into the same stacked experts as Qwen MoE
(layers/moe.py: w1 is the gate projection, w3 the up projection, w2 the down projection).
"""
from __future__ import annotations

import re

from worker_service.layers.moe import expert_target
from worker_service.models.llama import window_on_every_layer
from worker_service.models.qwen_moe import Qwen3MoeForCausalLM

_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    """Mistral's attention (no q/k norm, no biases) and sparse MLPs on every layer."""

    qk_norm = False
    default_sliding_window = None          # MixtralConfig's: no window unless the key sets one
    layer_windows = classmethod(window_on_every_layer)

    @staticmethod
    def checkpoint_target(name: str):
        """block_sparse_moe.* -> mlp.*, experts' w1/w2/w3 -> the stacked expert parameters."""
        if ".block_sparse_moe." not in name:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = _EXPERT.sub(lambda m: f".experts.{m[1]}.{_PROJ[m[2]]}.", name)
        return expert_target(name) or (name, None)
