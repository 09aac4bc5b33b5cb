"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text: gemma-3-1b, gemma-3-270m), as
transformers' modeling_gemma3 computes them.

Where Gemma differs from the Llama decoder (models/llama.py):
  - the embeddings are scaled by sqrt(hidden_size), the scale rounded to the activation dtype;
  - RMSNorm is x * (1 + weight), normalised and scaled in float32, rounded once at the end;
  - four norms per layer: input and post_attention around attention, pre_ and
    post_feedforward around the MLP; each sub-block's output is normed before the residual add;
  - q/k RMSNorm per head (Gemma's norm) before rope;
  - the MLP is GeGLU: gelu_pytorch_tanh(gate) * up;
  - attention scale query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5);
  - sliding_attention layers have a window and their own rope table (rope_local_base_freq),
    full_attention layers rope_theta with rope_scaling (models/gemma3_config.py);
  - optional final-logit softcap (cap * tanh(logits / cap), in the model dtype); attention
    softcapping is refused at load.
fused_ops=True fuses the rope only (each layer passes its own cos/sin table to
kernels/fused_rope.py, and with a writes_kv_from_rope backend the same launch writes the KV
cache); the norms and GeGLU stay in torch: Gemma's norm rounds differently from the fused
RMSNorm kernel and there is no fused GeGLU.
"""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.attention import Attention
from worker_service.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_service.layers.linear import QKVParallelLinear, RowParallelLinear
from worker_service.layers.rotary import RotaryEmbedding
from worker_service.layers.sharding import default_weight_loader, new_param
from worker_service.models.gemma3_config import LAYER_TYPES, Gemma3Options
from worker_service.models.llama import DecoderArgs, DecoderMLP
from worker_service.models.causal_lm import CausalLMHeadMixin
from worker_service.parallel_state import TPGroup


class GemmaRMSNorm(nn.Module):
    """(x / rms(x)) * (1 + weight) in float32, rounded to x's dtype once (transformers'
    Gemma3RMSNorm; Llama's norm rounds before the weight product)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((dim,), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up over [..., 2 * inter] (Gemma's hidden_activation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3MLP(DecoderMLP):
    """down(gelu_tanh(gate(x)) * up(x)): Llama's MLP with Gemma's activation."""

    def __init__(self, args: DecoderArgs, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__(args, tp, dtype)
        self.act_fn = GeluTanhAndMul()


class Gemma3Attention(nn.Module):
    """qkv projection, Gemma q/k norm per head, this layer type's rope, paged attention (scale
    query_pre_attn_scalar ** -0.5, the layer's window), output projection."""

    def __init__(self, args: DecoderArgs, opts: Gemma3Options, rotary_emb: RotaryEmbedding,
                 tp: TPGroup, backend: AttentionBackend, dtype: torch.dtype,
                 sliding_window: int) -> None:
        super().__init__()
        d = args.head_dim
        self.qkv_proj = QKVParallelLinear(args.hidden_size, d, args.num_heads, args.num_kv_heads,
                                          args.qkv_bias, tp, dtype)
        self.o_proj = RowParallelLinear(args.num_heads * d, args.hidden_size, args.o_bias, tp,
                                        dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = d
        self.q_norm = GemmaRMSNorm(d, args.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, args.rms_norm_eps, dtype)
        self.rotary_emb = rotary_emb           # shared by the layers of one type
        self.attn = Attention(self.num_heads, self.num_kv_heads, d,
                              opts.query_pre_attn_scalar ** -0.5, backend, sliding_window)
        self.kv_in_rope = bool(rotary_emb.fused
                               and getattr(backend, "writes_kv_from_rope", False))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        if self.kv_in_rope:      # the rope launch also writes k/v into the cache
            kv_write = (v.reshape(k.shape), kv_cache,
                        meta.slot_mapping[:meta.num_actual_tokens])
            q, k = self.rotary_emb(positions, q, k, kv_write=kv_write)
            return self.o_proj(self.attn(q, k, v, kv_cache, meta, kv_written=True))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block: x + post_attn(attn(input(x))), then + post_ff(mlp(pre_ff(.)))."""

    def __init__(self, args: DecoderArgs, opts: Gemma3Options, rotary_emb: RotaryEmbedding,
                 tp: TPGroup, backend: AttentionBackend, dtype: torch.dtype,
                 sliding_window: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(args, opts, rotary_emb, tp, backend, dtype,
                                         sliding_window)
        self.mlp = Gemma3MLP(args, tp, dtype)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    """Scaled embedding, the layer stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, args: DecoderArgs, opts: Gemma3Options, max_position: int,
                 tp: TPGroup, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp, dtype)
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weight dtype
        scale = torch.tensor(args.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        # one cos/sin table per layer type, shared by that type's layers
        self.rotary = nn.ModuleDict({
            t: RotaryEmbedding(args.head_dim, max_position, opts.rope[t], args.fused_ops)
            for t in LAYER_TYPES})
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(args, opts, self.rotary[t], tp, backend, dtype, args.window(i))
            for i, t in enumerate(opts.layer_types))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)


class SoftcappedLMHead(ParallelLMHead):
    """The LM head, then cap * tanh(logits / cap) in the model dtype when `softcap` is set (as
    transformers applies final_logit_softcapping). With a cap the fused greedy path is off
    (it would return uncapped logprobs): greedy() answers None and the sampler takes the
    logits."""

    softcap: float | None = None

    def greedy(self, hidden: torch.Tensor, logprobs: bool = True):
        return None if self.softcap else super().greedy(hidden, logprobs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._model_dtype_logits(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


class Gemma3ForCausalLM(CausalLMHeadMixin, nn.Module):
    """A Gemma 3 text causal LM over the paged KV cache; same interface as
    models/llama.py's LlamaForCausalLM (forward -> hidden, compute_logits -> float32 logits)."""

    packed_modules = MappingProxyType({
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    })

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend: AttentionBackend,
                 dtype: torch.dtype, fused_ops: bool = False) -> None:
        super().__init__()
        opts = Gemma3Options.from_hf(hf_config)
        args = DecoderArgs.from_hf(hf_config, None, None, True, fused_ops)
        args = replace(args, layer_windows=opts.layer_windows,
                       tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", True)))
        self.args, self.options = args, opts
        self.dtype = dtype
        self.fused_ops = fused_ops
        max_position = int(hf_config.get("max_position_embeddings", 2048))
        self.model = Gemma3Model(args, opts, max_position, tp, attn_backend, dtype)
        self.lm_head = SoftcappedLMHead(args.vocab_size, args.hidden_size, tp, dtype)
        self.lm_head.softcap = opts.final_logit_softcapping
        if args.tie_word_embeddings:
            self.tie_lm_head()
        self.num_layers = args.num_layers
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads      # per rank
        self.head_dim = args.head_dim
