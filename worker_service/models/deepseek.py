"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM: V2, V2-Lite, V2.5, Coder-V2; DeepseekV3ForCausalLM:
V3, R1, Kimi-K2, Moonlight), as transformers' modeling_deepseek_v2 / modeling_deepseek_v3.

Llama's pre-norm decoder (models/llama.py) with
  - multi-head latent attention over a latent KV cache (layers/mla.py): one cached "head" of
    kv_lora_rank + qk_rope_head_dim per token, so the model reports num_kv_heads 1 and that
    head size to the cache allocator and to the memory estimate (kv_cache_dims);
  - dense MLPs (intermediate_size) on the first first_k_dense_replace layers, sparse blocks
    after (models/deepseek_config.py says which): DeepSeek's router (layers/deepseek_moe.py),
    the routed experts (layers/moe.py's MoEExperts) and n_shared_experts shared experts.
Config keys absent from config.json take the transformers config class's defaults.

The multi-token-prediction module a V3 checkpoint carries as model.layers.{num_hidden_layers}
is not served: its tensors are skipped, as transformers skips them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

import torch
from torch import nn

from worker_service.layers.deepseek_moe import DeepseekRouter, RoutingArgs
from worker_service.layers.mla import MlaArgs, MLAAttention, check_mla_backend
from worker_service.layers.moe import MoEExperts, expert_target
from worker_service.models.deepseek_config import (read_mla, read_routing, read_sparse_layers,
                                                   with_defaults)
from worker_service.models.llama import (DecoderArgs, DecoderLayer, DecoderModel,
                                         LlamaForCausalLM)
from worker_service.models.qwen_moe import MoeArgs, SharedExpert
from worker_service.parallel_state import TPGroup

LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class DeepseekArgs(DecoderArgs):
    """The decoder's fields plus the attention's (head_dim is the rope dims' width)."""

    mla: MlaArgs | None = None


def mla_attention(args: DeepseekArgs, rotary_emb, tp: TPGroup, backend, dtype: torch.dtype,
                  sliding_window: int = 0) -> MLAAttention:
    """DecoderLayer's attention_class call, building the latent attention."""
    return MLAAttention(args.mla, rotary_emb, tp, backend, dtype, args.fused_ops)


class DeepseekDecoderLayer(DecoderLayer):
    attention_class = staticmethod(mla_attention)


class DeepseekDecoderModel(DecoderModel):
    layer_class = DeepseekDecoderLayer


class DeepseekMoeBlock(nn.Module):
    """Router, routed experts and the shared experts. Parameter names follow the checkpoints:
    mlp.gate.weight (+ e_score_correction_bias on V3), mlp.experts.*, mlp.shared_experts.*;
    both expert kinds give this rank's partial sum, all-reduced once."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, n_shared_experts: int,
                 routing: RoutingArgs, tp: TPGroup, dtype: torch.dtype,
                 fused_ops: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.gate = DeepseekRouter(hidden_size, routing)
        self.experts = MoEExperts(routing.num_experts, hidden_size, moe_intermediate_size, tp,
                                  dtype, fused_ops)
        self.shared_experts = None
        if n_shared_experts:
            self.shared_experts = SharedExpert(hidden_size,
                                               moe_intermediate_size * n_shared_experts, tp,
                                               dtype, fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights.to(x.dtype), ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2: softmax routing (greedy or group-limited), rope dims always interleaved."""

    v3 = False
    decoder_class = DeepseekDecoderModel
    # the latent is both the key and the value (layers/mla.py): the cache holds it once
    kv_values_are_keys = True
    # the dense MLPs' and shared experts' gate/up packed; q_proj (V2-Lite) stays as it is
    packed_modules = MappingProxyType({"gate_proj": ("gate_up_proj", 0),
                                       "up_proj": ("gate_up_proj", 1)})

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend, dtype: torch.dtype,
                 fused_ops: bool = False) -> None:
        cfg = with_defaults(hf_config, self.v3)
        mla = read_mla(cfg, self.v3)
        check_mla_backend(attn_backend, mla, max(1, mla.num_heads // tp.world_size), dtype)
        super().__init__(cfg, tp, attn_backend, dtype, fused_ops)
        self.num_kv_heads = 1                       # the latent cache (layers/mla.py)
        self.head_dim = self.args.mla.latent_dim

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> DeepseekArgs:
        mla = read_mla(hf_config, self.v3)
        base = DecoderArgs.from_hf({**hf_config, "head_dim": mla.qk_rope_head_dim,
                                    "num_key_value_heads": mla.num_heads},
                                   False, False, False, fused_ops)
        return DeepseekArgs(**{f: getattr(base, f) for f in base.__dataclass_fields__},
                            mla=mla)

    @property
    def graph_capture_blocker(self) -> str | None:
        """Why CUDA decode graphs cannot capture this model, or None (models/qwen_moe.py)."""
        if all(m.fused for m in self.modules() if isinstance(m, MoEExperts)):
            return None
        return "MoE experts group tokens with a host sync"

    def mlp_factory(self, hf_config: dict, tp: TPGroup,
                    dtype: torch.dtype) -> Callable[[int], nn.Module | None]:
        sparse = read_sparse_layers(hf_config)
        routing = read_routing(hf_config, self.v3)
        hidden, fused = self.args.hidden_size, self.args.fused_ops
        return lambda i: (DeepseekMoeBlock(hidden, sparse.moe_intermediate_size,
                                           sparse.n_shared_experts, routing, tp, dtype, fused)
                          if sparse.is_sparse(i) else None)

    @staticmethod
    def checkpoint_target(name: str):
        """Per-expert checkpoint tensors -> the stacked expert parameters (loader.target_of)."""
        return expert_target(name)

    def split_checkpoint_tensor(self, name: str, tensor_slice):
        """No pieces for the MTP layers past num_hidden_layers (skipped); None otherwise."""
        m = LAYER_INDEX.match(name)
        return [] if m is not None and int(m[1]) >= self.num_layers else None

    # -- read by runner/memory_fit.py and the cache layout before anything is built --

    @classmethod
    def kv_cache_dims(cls, hf_config: dict) -> tuple[int, int]:
        """(kv heads, head size) of the cache: one latent head."""
        return 1, read_mla(with_defaults(hf_config, cls.v3), cls.v3).latent_dim

    @classmethod
    def kv_value_dim(cls, hf_config: dict) -> int:
        """The value's dims of each cached row: the latent's first kv_lora_rank."""
        return read_mla(with_defaults(hf_config, cls.v3), cls.v3).kv_lora_rank

    @classmethod
    def attention_elements(cls, hf_config: dict) -> int:
        """One layer's attention weights (q, the latent projections, kv_b, o, two norms)."""
        m = read_mla(with_defaults(hf_config, cls.v3), cls.v3)
        norms = m.kv_lora_rank + (m.q_lora_rank or 0)
        return (cls.attention_linear_elements(hf_config) + norms
                + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim))

    @classmethod
    def attention_linear_elements(cls, hf_config: dict) -> int:
        """One layer's attention weights that run as CPU linears (q or q_a and q_b, kv_a, o):
        all but kv_b, which is read as matrices (mla.LatentUpProjection), and the norms."""
        m = read_mla(with_defaults(hf_config, cls.v3), cls.v3)
        q_out = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        q = (m.hidden_size * m.q_lora_rank + m.q_lora_rank * q_out
             if m.q_lora_rank else m.hidden_size * q_out)
        return q + m.hidden_size * m.latent_dim + m.num_heads * m.v_head_dim * m.hidden_size

    @classmethod
    def replicated_attention_elements(cls, hf_config: dict) -> int:
        """The part of attention_linear_elements every rank holds whole (q_a, kv_a)."""
        m = read_mla(with_defaults(hf_config, cls.v3), cls.v3)
        return m.hidden_size * ((m.q_lora_rank or 0) + m.latent_dim)

    @classmethod
    def moe_args(cls, hf_config: dict) -> MoeArgs:
        """The sparse layers in MoeArgs' terms (the dense ones as mlp_only_layers)."""
        cfg = with_defaults(hf_config, cls.v3)
        sparse, routing = read_sparse_layers(cfg), read_routing(cfg, cls.v3)
        dense = frozenset(i for i in range(sparse.num_layers) if not sparse.is_sparse(i))
        return MoeArgs(hidden_size=int(cfg["hidden_size"]), num_experts=routing.num_experts,
                       top_k=routing.top_k, moe_intermediate_size=sparse.moe_intermediate_size,
                       norm_topk_prob=routing.norm_topk_prob, decoder_sparse_step=1,
                       mlp_only_layers=dense,
                       shared_expert_intermediate_size=(sparse.moe_intermediate_size
                                                        * sparse.n_shared_experts))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: sigmoid routing with the correction bias over groups (noaux_tc), the rope
    dims interleaved per rope_interleave."""

    v3 = True
