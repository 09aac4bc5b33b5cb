"""StarCoder2 (Starcoder2ForCausalLM: bigcode/starcoder2-3b/7b/15b), as transformers'
modeling_starcoder2 computes it: Llama's pre-norm decoder (models/llama.py) with

  - LayerNorm (weight and bias, `norm_epsilon`, 1e-5 by default) for every norm, the residual
    sums in the activation dtype as transformers adds them;
  - a plain MLP, c_proj(act(c_fc(x))), column- then row-parallel, act `gelu_pytorch_tanh`
    (or the exact `gelu`; any other refused);
  - biases on q/k/v/o and on the MLP by `use_bias` (true by default);
  - `sliding_window` (when set: 4096 on the released checkpoints) on every layer, as Mistral's;
    absent or null, none (Starcoder2Config's default);
  - the LM head tied unless `tie_word_embeddings` is false (Starcoder2Config's default true).

LoRA: lora/families.py (c_fc / c_proj are the targets' names).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker_service.layers.norm import ResidualInterface
from worker_service.models.bert import LayerNorm
from worker_service.models.llama import (DecoderArgs, DecoderLayer, DecoderModel,
                                         LlamaForCausalLM, window_on_every_layer)
from worker_service.parallel_state import TPGroup

DEFAULT_NORM_EPS = 1e-5         # Starcoder2Config's norm_epsilon
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}     # -> F.gelu's approximate


class ResidualLayerNorm(ResidualInterface, LayerNorm):
    """LayerNorm with Llama's residual interface."""


class Starcoder2MLP(nn.Module):
    """c_proj(gelu(c_fc(x))): not gated; the checkpoint's names."""

    def __init__(self, args: DecoderArgs, approximate: str, tp: TPGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(args.hidden_size, args.intermediate_size,
                                         args.mlp_bias, tp, dtype)
        self.c_proj = RowParallelLinear(args.intermediate_size, args.hidden_size, args.mlp_bias,
                                        tp, dtype)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Starcoder2DecoderLayer(DecoderLayer):
    """Llama's pre-norm block with LayerNorms."""

    def __init__(self, args: DecoderArgs, *rest) -> None:
        super().__init__(args, *rest)
        dtype = self.input_layernorm.weight.dtype
        self.input_layernorm = ResidualLayerNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = ResidualLayerNorm(args.hidden_size, args.rms_norm_eps,
                                                          dtype)


class Starcoder2Model(DecoderModel):
    """Llama's decoder with StarCoder2's blocks and a final LayerNorm."""

    layer_class = Starcoder2DecoderLayer

    def __init__(self, args: DecoderArgs, *rest, **kwargs) -> None:
        super().__init__(args, *rest, **kwargs)
        self.norm = ResidualLayerNorm(args.hidden_size, args.rms_norm_eps,
                                      self.norm.weight.dtype)


def gelu_approximation(cfg: dict) -> str:
    """F.gelu's `approximate` for config.json's hidden_act, or a ValueError naming it."""
    act = cfg.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported for "
                         f"Starcoder2ForCausalLM: must be one of {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[act]


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """A StarCoder2 causal LM over the paged KV cache (interface as LlamaForCausalLM's)."""

    decoder_class = Starcoder2Model
    layer_windows = classmethod(window_on_every_layer)     # default_sliding_window: None
    mlp_matrices = 2                   # c_fc, c_proj: not gated
    tie_by_default = True              # Starcoder2Config's

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> DecoderArgs:
        gelu_approximation(hf_config)
        bias = bool(hf_config.get("use_bias", True))
        args = DecoderArgs.from_hf({"tie_word_embeddings": self.tie_by_default, **hf_config},
                                   bias, bias, False, fused_ops)
        eps = hf_config.get("norm_epsilon")
        return replace(args, mlp_bias=bias,
                       rms_norm_eps=float(DEFAULT_NORM_EPS if eps is None else eps))

    def mlp_factory(self, hf_config: dict, tp: TPGroup, dtype: torch.dtype):
        approximate = gelu_approximation(hf_config)
        return lambda layer: Starcoder2MLP(self.args, approximate, tp, dtype)
