"""Gemma (1) (GemmaForCausalLM: gemma-2b, gemma-7b, CodeGemma, gemma-1.1), as transformers'
modeling_gemma computes it: Llama's pre-norm decoder (models/llama.py) with Gemma's parts,
reused from models/gemma3.py:

  - the embeddings times sqrt(hidden_size), that scale a float32 tensor cast to the
    activation dtype (as transformers' GemmaTextScaledWordEmbedding);
  - RMSNorm as x / rms(x) * (1 + weight) in float32, rounded once (GemmaRMSNorm), on the
    input and post-attention norms and the final norm; the residual sums in the activation
    dtype, as transformers adds them;
  - a GeGLU MLP, gelu_pytorch_tanh(gate) * up, without biases (transformers ignores mlp_bias);
    `hidden_act` "gelu" is the Hub checkpoints' legacy spelling of the same (GemmaConfig
    rewrites it), any other activation is refused;
  - attention scale head_dim ** -0.5, one rope table, no window and no softcap;
  - head_dim 256 and a tied LM head when config.json does not say (GemmaConfig's defaults).

use_bidirectional_attention is refused (the backends are causal). LoRA: lora/families.py.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.norm import ResidualInterface
from worker_service.models.gemma3 import Gemma3MLP, GemmaRMSNorm
from worker_service.models.llama import DecoderArgs, DecoderLayer, DecoderModel, LlamaForCausalLM
from worker_service.parallel_state import TPGroup

DEFAULT_HEAD_DIM = 256          # GemmaConfig's
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


class GemmaNorm(ResidualInterface, GemmaRMSNorm):
    """Gemma's RMSNorm with Llama's residual interface."""


class GemmaDecoderLayer(DecoderLayer):
    """Llama's pre-norm block with Gemma's norms."""

    def __init__(self, args: DecoderArgs, *rest) -> None:
        super().__init__(args, *rest)
        dtype = self.input_layernorm.weight.dtype
        self.input_layernorm = GemmaNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = GemmaNorm(args.hidden_size, args.rms_norm_eps, dtype)


class GemmaModel(DecoderModel):
    """Llama's decoder with Gemma's blocks and final norm, the embeddings times sqrt(hidden)."""

    layer_class = GemmaDecoderLayer

    def __init__(self, args: DecoderArgs, hf_config: dict, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype, make_mlp=None) -> None:
        super().__init__(args, hf_config, tp, backend, dtype, make_mlp)
        self.norm = GemmaNorm(args.hidden_size, args.rms_norm_eps, dtype)
        scale = torch.tensor(args.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def refuse_unsupported(cfg: dict) -> None:
    """ValueError naming what a Gemma config may ask that is not served."""
    act = cfg.get("hidden_act") or ACTIVATIONS[0]
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported for "
                         f"GemmaForCausalLM: must be one of {ACTIVATIONS}")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true is not supported: the "
                         "attention backends are causal")


class GemmaForCausalLM(LlamaForCausalLM):
    """A Gemma causal LM over the paged KV cache (interface as LlamaForCausalLM's)."""

    decoder_class = GemmaModel
    tie_by_default = True              # GemmaConfig's
    default_head_dim = DEFAULT_HEAD_DIM

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> DecoderArgs:
        refuse_unsupported(hf_config)
        cfg = {**hf_config, "head_dim": hf_config.get("head_dim") or self.default_head_dim}
        args = super().decoder_args(cfg, fused_ops)
        return replace(args, mlp_bias=False)

    def mlp_factory(self, hf_config: dict, tp: TPGroup, dtype: torch.dtype):
        return lambda layer: Gemma3MLP(self.args, tp, dtype)
