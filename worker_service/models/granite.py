"""IBM Granite 3.x dense models (GraniteForCausalLM), as transformers' modeling_granite computes
them: the Llama decoder (models/llama.py) with four scalars from config.json, each a number
(default 1.0, as GraniteConfig's):

  - embedding_multiplier: the token embeddings are multiplied by it;
  - residual_multiplier: each sub-block's output (attention, MLP) is multiplied by it before
    its residual add;
  - attention_multiplier: IS the attention softmax scale (in place of head_dim ** -0.5), so
    every attention backend takes it as it takes Gemma's query_pre_attn_scalar ** -0.5;
  - logits_scaling: the LM head's logits are DIVIDED by it (in the model dtype), before sampling
    and logprobs. With a scale other than 1 the fused greedy head is off (its logprobs would be
    unscaled): greedy() answers None and the sampler reads the scaled logits.

A non-finite multiplier and logits_scaling=0 are refused (transformers would produce inf/NaN);
other values, negative ones included, are served as transformers computes them. LoRA:
lora/families.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.embedding import ParallelLMHead
from worker_service.models.causal_lm import refuse_activation
from worker_service.models.llama import (DecoderArgs, DecoderAttention, DecoderLayer, DecoderMLP,
                                         DecoderModel, LlamaForCausalLM)
from worker_service.parallel_state import TPGroup

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
               "logits_scaling")


@dataclass(frozen=True)
class GraniteArgs(DecoderArgs):
    """DecoderArgs plus Granite's scalars (attention_multiplier is DecoderArgs.attn_scale)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


def granite_multipliers(cfg: dict) -> dict[str, float]:
    """The four scalars of config.json (absent: 1.0), or ValueError naming a bad one."""
    values = {}
    for key in MULTIPLIERS:
        value = cfg.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"config.json: {key}={value!r} is invalid: must be a finite number")
        values[key] = float(value)
    if values["logits_scaling"] == 0:
        raise ValueError("config.json: logits_scaling=0 is invalid: the logits are divided by "
                         "it; must be a non-zero number")
    return values


class GraniteAttention(DecoderAttention):
    """Llama's attention (scale: DecoderArgs.attn_scale), its output times residual_multiplier
    (transformers scales it just before the residual add: the same product)."""

    def __init__(self, args: GraniteArgs, *rest) -> None:
        super().__init__(args, *rest)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, *inputs) -> torch.Tensor:
        return super().forward(*inputs) * self.residual_multiplier


class GraniteMLP(DecoderMLP):
    """Llama's MLP, its output times residual_multiplier."""

    def __init__(self, args: GraniteArgs, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__(args, tp, dtype)
        self.residual_multiplier = args.residual_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteDecoderLayer(DecoderLayer):
    """Llama's pre-norm block with Granite's attention (its MLP comes from mlp_factory)."""

    attention_class = GraniteAttention


class GraniteModel(DecoderModel):
    """Llama's decoder with Granite's blocks and the embeddings times embedding_multiplier."""

    layer_class = GraniteDecoderLayer

    def __init__(self, args: GraniteArgs, *rest, **kwargs) -> None:
        super().__init__(args, *rest, **kwargs)
        self.embedding_multiplier = args.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids) * self.embedding_multiplier, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class ScaledLMHead(ParallelLMHead):
    """The LM head, its model-dtype logits divided by logits_scaling (transformers' order)."""

    logits_scaling: float = 1.0

    def greedy(self, hidden: torch.Tensor, logprobs: bool = True):
        return None if self.logits_scaling != 1.0 else super().greedy(hidden, logprobs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._model_dtype_logits(hidden)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits.float()


class GraniteForCausalLM(LlamaForCausalLM):
    """A Granite causal LM over the paged KV cache (interface as LlamaForCausalLM's)."""

    decoder_class = GraniteModel
    lm_head_class = ScaledLMHead

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend: AttentionBackend,
                 dtype: torch.dtype, fused_ops: bool = False) -> None:
        super().__init__(hf_config, tp, attn_backend, dtype, fused_ops)
        self.lm_head.logits_scaling = self.args.logits_scaling

    def mlp_factory(self, hf_config: dict, tp: TPGroup, dtype: torch.dtype):
        return lambda layer: GraniteMLP(self.args, tp, dtype)

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> GraniteArgs:
        refuse_activation(hf_config, type(self).__name__)
        scalars = granite_multipliers(hf_config)
        base = super().decoder_args(hf_config, fused_ops)
        return GraniteArgs(**{**asdict(base), "attn_scale": scalars["attention_multiplier"]},
                           embedding_multiplier=scalars["embedding_multiplier"],
                           residual_multiplier=scalars["residual_multiplier"],
                           logits_scaling=scalars["logits_scaling"])
