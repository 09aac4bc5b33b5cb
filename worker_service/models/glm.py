"""GLM (GlmForCausalLM: glm-4-9b-chat-hf) and GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414, GLM-Z1), as
transformers' modeling_glm / modeling_glm4 compute them: Llama's pre-norm decoder
(models/llama.py) with

  - rope over the first half of each head (partial_rotary_factor, 0.5 when config.json does
    not say: GlmConfig's and Glm4Config's default), rotating interleaved pairs: the q/k rows
    are reordered at load so our rotate-half ropes rotate the same pairs (models/pair_rope.py);
  - biases on q/k/v by attention_bias (true by default), none on o_proj;
  - the checkpoint's fused mlp.gate_up_proj (gate rows first) cut at load into gate and up
    (models/phi3.py's split_fused_projection), silu(gate) * up;
  - GLM-4 only: two more RMSNorms per layer, post_self_attn_layernorm on the attention output
    and post_mlp_layernorm on the MLP output, each before its residual add;
  - GlmConfig's / Glm4Config's defaults for keys config.json lacks: head_dim 128, 2 kv heads,
    rms_norm_eps 1.5625e-7, an untied head.

hidden_act other than silu is refused naming it; no sliding window (a config that turns one on
is refused, as for Llama). LoRA: lora/families.py (gate_up_proj and q/k as the weights).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.norm import RMSNorm
from worker_service.models.causal_lm import refuse_activation
from worker_service.models.llama import DecoderArgs, DecoderLayer, DecoderModel, LlamaForCausalLM
from worker_service.models.pair_rope import PairRopeCheckpoint
from worker_service.models.phi3 import split_fused_projection
from worker_service.parallel_state import TPGroup

# GlmConfig's and Glm4Config's values for keys a config.json may lack
CONFIG_DEFAULTS = MappingProxyType({"head_dim": 128, "num_key_value_heads": 2,
                                    "rms_norm_eps": 1.5625e-7, "attention_bias": True,
                                    "partial_rotary_factor": 0.5})


def with_glm_defaults(hf_config: dict) -> dict:
    """config.json with GlmConfig's defaults for absent keys (partial_rotary_factor only when
    neither the top level nor the rope dict sets one, as transformers' setdefault)."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    defaults = dict(CONFIG_DEFAULTS)
    if "partial_rotary_factor" in rope:
        del defaults["partial_rotary_factor"]
    return {**defaults, **hf_config}


class GlmForCausalLM(PairRopeCheckpoint, LlamaForCausalLM):
    """A GLM causal LM over the paged KV cache (interface as LlamaForCausalLM's)."""

    o_bias = False
    default_head_dim = CONFIG_DEFAULTS["head_dim"]

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend: AttentionBackend,
                 dtype: torch.dtype, fused_ops: bool = False) -> None:
        hf_config = with_glm_defaults(hf_config)
        super().__init__(hf_config, tp, attn_backend, dtype, fused_ops)
        self.set_pair_rotary_dim(hf_config)

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> DecoderArgs:
        refuse_activation(hf_config, type(self).__name__)
        return super().decoder_args(hf_config, fused_ops)

    def split_checkpoint_tensor(self, name: str, tensor: Any) -> list[tuple[str, Any]] | None:
        """gate_up_proj cut into gate and up; q/k reordered (PairRopeCheckpoint)."""
        return split_fused_projection(self.args, name, tensor) or \
            super().split_checkpoint_tensor(name, tensor)


class Glm4DecoderLayer(DecoderLayer):
    """Llama's pre-norm block with a norm on each sub-block's output before its residual add."""

    def __init__(self, args: DecoderArgs, *rest) -> None:
        super().__init__(args, *rest)
        dtype = self.input_layernorm.weight.dtype
        self.post_self_attn_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype,
                                                args.fused_ops)
        self.post_mlp_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype,
                                          args.fused_ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4Model(DecoderModel):
    """Llama's decoder with GLM-4's blocks."""

    layer_class = Glm4DecoderLayer


class Glm4ForCausalLM(GlmForCausalLM):
    """A GLM-4 causal LM over the paged KV cache (interface as LlamaForCausalLM's)."""

    decoder_class = Glm4Model
