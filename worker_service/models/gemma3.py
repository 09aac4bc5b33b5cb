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
  - optional final-logit softcap (cap * tanh(logits / cap), in the model dtype); an attention
    logit softcap is refused for Gemma 3 (gemma3_config.py) and applied for Gemma 2.
models/gemma2.py reuses all of this with Gemma 2's config reading and attention.
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

from engine_common.model_files.model_dir import model_position_limit
from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_service.layers.rotary import RotaryEmbedding
from worker_service.layers.sharding import default_weight_loader, new_param
from worker_service.models.gemma3_config import DEFAULT_HEAD_DIM, LAYER_TYPES, Gemma3Options
from worker_service.models.llama import DecoderArgs, DecoderAttention, DecoderMLP
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


class Gemma3Attention(DecoderAttention):
    """Llama's attention (projections, rope, paged attention) with Gemma's q/k norm per head
    before rope, scale query_pre_attn_scalar ** -0.5, the layer's window and the attention
    softcap (if any)."""

    def __init__(self, args: DecoderArgs, opts, rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype, sliding_window: int) -> None:
        # qk_norm off for the base: its norms round as Llama's (and may fuse into the rope)
        super().__init__(replace(args, qk_norm=False), rotary_emb, tp, backend, dtype,
                         sliding_window, scale=opts.query_pre_attn_scalar ** -0.5,
                         softcap=opts.attn_logit_softcapping or 0.0)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        if self.kv_in_rope:      # the rope launch also writes k/v into the cache
            slots = meta.for_window(self.attn.sliding_window).slot_mapping   # its KV group's
            kv_write = (v.reshape(k.shape), kv_cache, slots[:meta.num_actual_tokens])
            q, k = self.rotary_emb(positions, q, k, kv_write=kv_write)
            return self.o_proj(self.attn(q, k, v, kv_cache, meta, kv_written=True))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich-norm block: x + post_attn(attn(input(x))), then + post_ff(mlp(pre_ff(.)))."""

    def __init__(self, self_attn: nn.Module, args: DecoderArgs, tp: TPGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = self_attn
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
    """Scaled embedding, the layer stack and the final norm (HF's `model.` prefix).
    attention_class: the layers' attention (Gemma3Attention, models/gemma2.py's)."""

    def __init__(self, args: DecoderArgs, opts, max_position: int, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype,
                 attention_class: type[nn.Module] = Gemma3Attention) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp, dtype)
        # transformers keeps sqrt(hidden) as a float32 tensor and casts it to the weight dtype
        scale = torch.tensor(args.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale, persistent=False)
        # one cos/sin table per distinct rope settings, shared by the layer types that use it
        # (Gemma 2's two types share one); RopeSettings hold a dict, so matched by equality
        tables: list[tuple] = []
        for t in LAYER_TYPES:
            if not any(settings == opts.rope[t] for settings, _ in tables):
                tables.append((opts.rope[t], RotaryEmbedding(args.head_dim, max_position,
                                                             opts.rope[t], args.fused_ops)))
        self.rotary = nn.ModuleDict({t: next(table for settings, table in tables
                                             if settings == opts.rope[t]) for t in LAYER_TYPES})
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(attention_class(args, opts, self.rotary[t], tp, backend, dtype,
                                               args.window(i)), args, tp, dtype)
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
    # what Gemma 2 (models/gemma2.py) swaps: its config reading and its attention
    options_class = Gemma3Options
    attention_class = Gemma3Attention
    tie_by_default = True              # Gemma2Config's and Gemma3TextConfig's
    default_head_dim = DEFAULT_HEAD_DIM

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend: AttentionBackend,
                 dtype: torch.dtype, fused_ops: bool = False) -> None:
        super().__init__()
        opts = self.options_class.from_hf(hf_config)
        cap = opts.attn_logit_softcapping
        if cap and not getattr(attn_backend, "supports_softcap", False):
            raise ValueError(f"{type(self).__name__} (attn_logit_softcapping={cap}): the "
                             f"{attn_backend.name!r} attention backend cannot apply an attention "
                             f"softcap (it would attend uncapped); pick one that does: torch, "
                             f"cpu, triton or flash_attn")
        # head_dim absent: the config classes' 256 (not hidden / heads)
        hf_config = {**hf_config, "head_dim": hf_config.get("head_dim") or self.default_head_dim}
        args = DecoderArgs.from_hf(hf_config, None, None, False, fused_ops)
        args = replace(args, layer_windows=opts.layer_windows,
                       tie_word_embeddings=bool(hf_config.get("tie_word_embeddings",
                                                              self.tie_by_default)))
        self.args, self.options = args, opts
        self.dtype = dtype
        self.fused_ops = fused_ops
        # the rope table covers the engine's max length (absent key: the config class default)
        max_position = model_position_limit(hf_config)
        self.model = Gemma3Model(args, opts, max_position, tp, attn_backend, dtype,
                                 self.attention_class)
        self.lm_head = SoftcappedLMHead(args.vocab_size, args.hidden_size, tp, dtype)
        self.lm_head.softcap = opts.final_logit_softcapping
        if args.tie_word_embeddings:
            self.tie_lm_head()
        self.num_layers = args.num_layers
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads      # per rank
        self.head_dim = args.head_dim
