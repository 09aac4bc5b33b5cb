"""OLMo 2 (Olmo2ForCausalLM: OLMo-2-1B/7B/13B/32B), as transformers' modeling_olmo2 computes it.

Where OLMo 2 differs from the Llama decoder (models/llama.py):
  - q_norm / k_norm are RMSNorms over the WHOLE q (num_heads * head_dim) and k
    (num_kv_heads * head_dim) projection outputs, not per head, applied before rope;
  - no norm before attention or the MLP: each sub-block's output is normed
    (post_attention_layernorm, post_feedforward_layernorm) before its residual add;
  - every RMSNorm multiplies the weight into the float32 normed value and rounds once
    (Llama's rounds before the weight product);
  - the MLP never has a bias (config's mlp_bias is not read); attention_bias covers q/k/v/o.

Tensor parallelism: a rank holds a slice of the heads, so the q/k norm's mean square spans ranks:
each rank sums the squares of its slice and the sums are all-reduced (one [T, 2] all-reduce per
layer). Replicated kv heads (num_key_value_heads < tp size) are held by tp / num_kv_heads ranks
each, so the sum over ranks divided by tp * local width is still the mean over every element.
fused_ops fuses the rope only (the norms stay in torch). LoRA: lora/families.py.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_service.layers.rotary import RotaryEmbedding, get_rope
from worker_service.layers.sharding import (copy_checked, default_weight_loader, new_param,
                                            read_rows)
from worker_service.models.causal_lm import CausalLMHeadMixin, refuse_activation
from worker_service.models.llama import (DecoderArgs, DecoderAttention, DecoderMLP,
                                         LlamaForCausalLM)
from worker_service.parallel_state import TPGroup

DEFAULT_RMS_NORM_EPS = 1e-5        # Olmo2Config's (a config.json without the key)


class Olmo2RMSNorm(nn.Module):
    """weight * (x / rms(x)) in float32, rounded to x's dtype once (transformers' Olmo2RMSNorm).

    With `tp` (the q/k norms) x is this rank's slice of the normed width: the weight is the
    matching slice (rows start .. start + width of the checkpoint's) and the mean square is
    taken over every rank's slice (sum of squares all-reduced)."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype,
                 tp: TPGroup | None = None, start: int = 0) -> None:
        super().__init__()
        self.eps = eps
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.start = start
        loader = self._slice_loader if self.tp is not None else default_weight_loader
        self.weight = new_param((width,), dtype, loader)

    def _slice_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        width = param.shape[0]
        copy_checked(param.data, read_rows(loaded, 0, self.start, width), "norm slice")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.tp is None:
            mean_square = x32.pow(2).mean(-1, keepdim=True)
        else:
            total = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True))
            mean_square = total / (x.shape[-1] * self.tp.world_size)
        return (self.weight * (x32 * torch.rsqrt(mean_square + self.eps))).to(x.dtype)


class Olmo2Attention(DecoderAttention):
    """Llama's attention with RMSNorm over the whole q and k projections before rope."""

    def __init__(self, args: DecoderArgs, rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(replace(args, qk_norm=False), rotary_emb, tp, backend, dtype)
        eps, d = args.rms_norm_eps, args.head_dim
        self.q_norm = Olmo2RMSNorm(self.q_size, eps, dtype, tp, tp.rank * self.q_size)
        self.k_norm = Olmo2RMSNorm(self.kv_size, eps, dtype, tp,
                                   self.qkv_proj.kv_head_start * d)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).reshape(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(k).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kv_in_rope:          # the rope launch also writes k/v into the cache
            return self._forward_kv_in_rope(positions, q, k, v, kv_cache, meta)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Olmo2DecoderLayer(nn.Module):
    """Post-norm block: x + post_attn(attn(x)), then + post_ff(mlp(.))."""

    def __init__(self, args: DecoderArgs, rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(args, rotary_emb, tp, backend, dtype)
        self.mlp = DecoderMLP(args, tp, dtype)
        self.post_attention_layernorm = Olmo2RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = Olmo2RMSNorm(args.hidden_size, args.rms_norm_eps,
                                                       dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(positions, hidden, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2Model(nn.Module):
    """Embedding, the layer stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, args: DecoderArgs, hf_config: dict, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp, dtype)
        rotary_emb = get_rope(args.head_dim, hf_config, args.fused_ops)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(args, rotary_emb, tp, backend, dtype)
                                    for _ in range(args.num_layers))
        self.norm = Olmo2RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)


class Olmo2ForCausalLM(CausalLMHeadMixin, nn.Module):
    """An OLMo 2 causal LM over the paged KV cache; same interface as LlamaForCausalLM."""

    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend: AttentionBackend,
                 dtype: torch.dtype, fused_ops: bool = False) -> None:
        super().__init__()
        refuse_activation(hf_config, type(self).__name__)
        hf_config = {"rms_norm_eps": DEFAULT_RMS_NORM_EPS, **hf_config}
        args = DecoderArgs.from_hf(hf_config, None, None, False, fused_ops)
        # transformers' Olmo2MLP has no bias whatever mlp_bias says; no sliding window
        self.args = args = replace(args, mlp_bias=False)
        self.dtype = dtype
        self.fused_ops = fused_ops
        self.model = Olmo2Model(args, hf_config, tp, attn_backend, dtype)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp, dtype)
        if args.tie_word_embeddings:
            self.tie_lm_head()
        self.num_layers = args.num_layers
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads      # per rank
        self.head_dim = args.head_dim
