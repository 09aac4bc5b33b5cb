"""One decoder for the Llama family: Llama 2/3 (incl. llama3 rope scaling), Mistral-like,
Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm before rope).

The differences between architectures are class attributes of thin subclasses (see the bottom
of this file and models/registry.py); nothing here branches on an architecture name.
Sliding windows are per layer (`layer_windows`, read from config.json as transformers does):
Mistral windows every layer; Qwen2/Qwen3 with use_sliding_window the layers layer_types marks
"sliding_attention" (else those from max_window_layers on); the others refuse a config that
asks for one rather than attend to every key.
Parameter names mirror the Hugging Face checkpoints except for the packed projections
(qkv_proj, gate_up_proj), which `packed_modules` maps back.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable

import torch
from torch import nn

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.activation import SiluAndMul
from worker_service.layers.attention import Attention
from worker_service.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_service.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear)
from worker_service.layers.norm import RMSNorm
from worker_service.layers.rotary import RotaryEmbedding, get_rope
from worker_service.models.causal_lm import CausalLMHeadMixin
from worker_service.parallel_state import TPGroup


@dataclass(frozen=True)
class DecoderArgs:
    """The shape and options of a decoder, read from a Hugging Face config.json dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    fused_ops: bool = False      # Triton RMSNorm (+ residual) and rope: kernels/fused_*.py
    # per layer: W > 0 attends to the last W positions only, 0 to all; () when no layer has one
    layer_windows: tuple[int, ...] = ()
    attn_scale: float | None = None    # softmax scale; None: head_dim ** -0.5 (Granite sets it)

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def shared_window(self) -> int:
        """The window every layer has (the largest, if they differ); 0 when some layer sees
        every key. The scheduler frees the KV blocks no layer's window reaches any more."""
        windows = self.layer_windows
        return max(windows) if windows and all(windows) else 0

    @classmethod
    def from_hf(cls, cfg: dict, qkv_bias: bool | None, o_bias: bool | None,
                qk_norm: bool, fused_ops: bool = False) -> "DecoderArgs":
        """qkv_bias / o_bias: None means "as config's attention_bias says"."""
        num_heads = int(cfg["num_attention_heads"])
        attention_bias = bool(cfg.get("attention_bias") or False)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(cfg.get("mlp_bias") or False),
            qk_norm=qk_norm,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            fused_ops=fused_ops)


class DecoderAttention(nn.Module):
    """qkv projection, optional per-head q/k norm, rope, paged attention, output projection.
    scale: None is head_dim ** -0.5; softcap: the attention logit cap (0: none).
    A subclass with has_sinks returns this rank's heads' sink logits from attention_sinks()
    (models/gpt_oss.py), which every attention call then gets."""

    has_sinks = False

    def attention_sinks(self) -> torch.Tensor | None:
        return None

    def __init__(self, args: DecoderArgs, rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype, sliding_window: int = 0,
                 scale: float | None = None, softcap: float = 0.0) -> None:
        super().__init__()
        d = args.head_dim
        self.qkv_proj = QKVParallelLinear(args.hidden_size, d, args.num_heads, args.num_kv_heads,
                                          args.qkv_bias, tp, dtype)
        self.o_proj = RowParallelLinear(args.num_heads * d, args.hidden_size, args.o_bias, tp,
                                        dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = d
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps, dtype, args.fused_ops)
            self.k_norm = RMSNorm(d, args.rms_norm_eps, dtype, args.fused_ops)
        self.qk_norm = args.qk_norm
        # shared by every layer: one cos/sin table per model; fused, it rotates q and k in place
        self.rotary_emb = rotary_emb
        scale = args.attn_scale if scale is None else scale
        self.attn = Attention(self.num_heads, self.num_kv_heads, d,
                              d ** -0.5 if scale is None else scale, backend, sliding_window,
                              softcap, self.has_sinks)
        # fused rope + a backend that allows it: the rope launch also writes the KV cache
        self.kv_in_rope = bool(args.fused_ops and rotary_emb.fused
                               and getattr(backend, "writes_kv_from_rope", False))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kv_in_rope:
            return self._forward_kv_in_rope(positions, q, k, v, kv_cache, meta)
        if self.qk_norm:       # normalised, then rotated (one launch when fused)
            q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, sinks=self.attention_sinks()))

    def _forward_kv_in_rope(self, positions, q, k, v, kv_cache, meta: AttentionMetadata):
        """One launch normalises (Qwen3), rotates and writes k/v into the cache; the backend
        then attends without writing. Same slots and bound as the backend's own write."""
        slots = meta.for_window(self.attn.sliding_window).slot_mapping     # its KV group's
        kv_write = (v.reshape(k.shape), kv_cache, slots[:meta.num_actual_tokens])
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        q, k = self.rotary_emb(positions, q, k, *norms, kv_write=kv_write)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, kv_written=True,
                                     sinks=self.attention_sinks()))


class DecoderMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up packed into one column-parallel matmul."""

    def __init__(self, args: DecoderArgs, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(args.hidden_size, [inter, inter],
                                                       args.mlp_bias, tp, dtype)
        self.down_proj = RowParallelLinear(inter, args.hidden_size, args.mlp_bias, tp, dtype)
        self.act_fn = SiluAndMul(args.fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is carried separately and added inside the norms."""

    attention_class = DecoderAttention      # a subclass's own attention (models/granite.py)

    def __init__(self, args: DecoderArgs, rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype,
                 mlp: nn.Module | None = None, sliding_window: int = 0) -> None:
        super().__init__()
        self.self_attn = self.attention_class(args, rotary_emb, tp, backend, dtype,
                                              sliding_window)
        self.mlp = DecoderMLP(args, tp, dtype) if mlp is None else mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype,
                                       args.fused_ops)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype,
                                                args.fused_ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm (HF's `model.` prefix)."""

    layer_class = DecoderLayer      # a subclass's own block (models/granite.py)

    def __init__(self, args: DecoderArgs, hf_config: dict, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype,
                 make_mlp: Callable[[int], nn.Module | None] | None = None) -> None:
        """make_mlp(layer index): that layer's MLP (e.g. a sparse MoE block); None or
        make_mlp None: the dense DecoderMLP."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp, dtype)
        rotary_emb = get_rope(args.head_dim, hf_config, args.fused_ops)
        self.layers = nn.ModuleList(
            self.layer_class(args, self.layer_rope(i, rotary_emb, hf_config), tp, backend,
                             dtype, make_mlp and make_mlp(i), args.window(i))
            for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, args.fused_ops)

    def layer_rope(self, layer: int, rotary_emb: RotaryEmbedding,
                   hf_config: dict) -> nn.Module:
        """Layer `layer`'s rope: the model's one table (models/smollm3.py's NoPE layers have
        none)."""
        return rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLMHeadMixin, nn.Module):
    """A causal LM over the paged KV cache.

    forward(input_ids [T] int64, positions [T] int64, kv_caches (one per layer), meta)
        -> hidden [T, hidden_size]
    compute_logits(hidden [N, hidden_size]) -> float32 [N, vocab_size] (gathered over ranks)

    fused_ops=True: every RMSNorm, the rope and the SiLU-and-mul run as Triton kernels
    (kernels/fused_norm.py, fused_rope.py, fused_silu_mul.py); CUDA, or Triton's interpreter on
    CPU.
    """

    # Architecture traits; subclasses override. None = follow config's attention_bias.
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False
    # weight matrices of a dense MLP (gate, up, down), whether an absent tie_word_embeddings
    # ties the head and the head_dim of a config without one (the transformers config class's
    # defaults): read by the model and by runner/memory_fit.py's estimate alike
    mlp_matrices: int = 3
    tie_by_default: bool = False
    # head_dim when config.json has none (None: hidden_size / num_attention_heads; Gemma: 256)
    default_head_dim: int | None = None
    # the decoder and head classes a subclass may swap (models/granite.py)
    decoder_class = DecoderModel
    lm_head_class = ParallelLMHead
    # checkpoint projection name -> (our packed module name, shard id)
    packed_modules = MappingProxyType({
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    })

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend: AttentionBackend,
                 dtype: torch.dtype, fused_ops: bool = False) -> None:
        super().__init__()
        args = self.decoder_args(hf_config, fused_ops)
        windows = self.layer_windows(hf_config, args.num_layers)
        if any(windows):
            args = replace(args, layer_windows=windows)
        self.args = args
        self.dtype = dtype
        self.fused_ops = fused_ops
        self.model = self.decoder_class(args, hf_config, tp, attn_backend, dtype,
                                        self.mlp_factory(hf_config, tp, dtype))
        self.lm_head = self.lm_head_class(args.vocab_size, args.hidden_size, tp, dtype)
        if args.tie_word_embeddings:
            self.tie_lm_head()
        first_attn = self.model.layers[0].self_attn
        self.num_layers = args.num_layers
        self.num_kv_heads = first_attn.num_kv_heads      # per rank
        self.head_dim = args.head_dim

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> DecoderArgs:
        """The decoder's shape and options from config.json (a subclass may add its own)."""
        return DecoderArgs.from_hf({"tie_word_embeddings": self.tie_by_default, **hf_config},
                                   self.qkv_bias, self.o_bias, self.qk_norm, fused_ops)

    # The window transformers' config class gives a config.json without the key (null: none):
    # 4096 for Mistral, Qwen2/Qwen3 and their MoE configs; LlamaConfig has no such field.
    default_sliding_window: int | None = None

    @classmethod
    def configured_window(cls, hf_config: dict) -> int:
        """config.json's sliding_window as transformers reads it: absent, the config class's
        default; null, 0 (none)."""
        return int(hf_config.get("sliding_window", cls.default_sliding_window) or 0)

    @classmethod
    def layer_windows(cls, hf_config: dict, num_layers: int) -> tuple[int, ...]:
        """Each layer's sliding window (0: none). Llama has none; a subclass without a rule of
        its own refuses a config that turns one on (use_sliding_window) rather than ignore it."""
        window = cls.configured_window(hf_config)
        if hf_config.get("use_sliding_window") and window:
            raise ValueError(f"config.json: use_sliding_window with sliding_window={window} "
                             f"is not supported for {cls.__name__}")
        return (0,) * num_layers

    def mlp_factory(self, hf_config: dict, tp: TPGroup,
                    dtype: torch.dtype) -> Callable[[int], nn.Module | None] | None:
        """Per-layer MLP builder for DecoderModel; None: every layer is dense (subclasses with
        sparse layers override; see models/qwen_moe.py)."""
        return None


def window_on_every_layer(cls, hf_config: dict, num_layers: int) -> tuple[int, ...]:
    """A layer_windows rule: sliding_window (when set) on every layer, as transformers'
    Mistral, Mixtral and Phi-3 models (which ignore layer_types)."""
    return (cls.configured_window(hf_config),) * num_layers


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama layout without biases; sliding_window (when set) on every layer, as
    transformers' MistralModel (which ignores layer_types)."""

    default_sliding_window = 4096         # MistralConfig's
    layer_windows = classmethod(window_on_every_layer)


def qwen_layer_windows(hf_config: dict, num_layers: int, window: int) -> tuple[int, ...]:
    """Qwen2/Qwen3 (transformers' Qwen2Config/Qwen3Config): no window unless use_sliding_window
    is true and `window` (configured_window: absent, the configs' 4096) is not 0; then the
    layers layer_types marks "sliding_attention", or without layer_types the layers
    i >= max_window_layers (28 by default)."""
    if not hf_config.get("use_sliding_window") or not window:
        return (0,) * num_layers
    types = hf_config.get("layer_types")
    if types is None:
        first = int(hf_config.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries: must have "
                         f"num_hidden_layers={num_layers}")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / 2.5: q/k/v projections always carry a bias, o_proj never does."""

    qkv_bias = True
    o_bias = False
    default_sliding_window = 4096         # Qwen2Config's

    @classmethod
    def layer_windows(cls, hf_config: dict, num_layers: int) -> tuple[int, ...]:
        return qwen_layer_windows(hf_config, num_layers, cls.configured_window(hf_config))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: RMSNorm over each q and k head before rope; biases follow attention_bias."""

    qk_norm = True
    default_sliding_window = 4096         # Qwen3Config's

    @classmethod
    def layer_windows(cls, hf_config: dict, num_layers: int) -> tuple[int, ...]:
        return qwen_layer_windows(hf_config, num_layers, cls.configured_window(hf_config))
