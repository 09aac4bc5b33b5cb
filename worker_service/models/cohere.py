"""Cohere (CohereForCausalLM: Command-R, Command-R+) and Cohere 2 (Cohere2ForCausalLM:
Command-R7B, Command-A), as transformers' modeling_cohere / modeling_cohere2 compute them:

  - one LayerNorm per layer without bias (mean and variance in float32, CohereLayerNorm), whose
    output feeds attention and the MLP in parallel: x + attn(ln(x)) + mlp(ln(x));
  - Cohere with use_qk_norm (Command-R+): a LayerNorm over each q and k head (weights
    [heads, head_dim]) before rope; Cohere2 has none;
  - rope rotating interleaved pairs (q/k rows reordered at load: models/pair_rope.py);
  - biases on q/k/v/o by attention_bias (false by default); a SiLU-gated MLP without biases;
  - the logits times logit_scale (0.0625 by default), in the model dtype; the head tied unless
    tie_word_embeddings is false;
  - Cohere2: layer_types (without it every sliding_window_pattern-th layer, 4 by default, full
    and the others sliding) with sliding_window (4096 by default) on the sliding layers; the
    full layers have no rope (NoRope: q and k unrotated), as Cohere2Attention;
  - rope_theta 500000 (CohereConfig) / 10000 (Cohere2Config) and layer_norm_eps 1e-5 when
    absent.

hidden_act other than silu, a logit_scale that is not a finite number, and a Cohere2 config
with sliding layers but no window are refused naming the key (all layers full: no window
needed, as transformers). LoRA: lora/families.py (lora_B q/k rows reordered as the weights).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from kernels.attention.backend import AttentionBackend, AttentionMetadata
from worker_service.layers.embedding import ParallelLMHead
from worker_service.layers.rotary import NoRope, RotaryEmbedding
from worker_service.layers.sharding import (copy_checked, default_weight_loader, new_param,
                                            read_rows)
from worker_service.models.causal_lm import refuse_activation
from worker_service.models.llama import (DecoderArgs, DecoderAttention, DecoderMLP,
                                         DecoderModel, LlamaForCausalLM)
from worker_service.models.pair_rope import PairRopeCheckpoint
from worker_service.parallel_state import TPGroup

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_PATTERN = 4               # Cohere2Config's sliding_window_pattern
COHERE_DEFAULTS = MappingProxyType({"rope_theta": 500000.0, "layer_norm_eps": 1e-5,
                                    "logit_scale": 0.0625, "sliding_window": 4096})


@dataclass(frozen=True)
class CohereArgs(DecoderArgs):
    """DecoderArgs plus Cohere's per-head q/k LayerNorm flag and logit scale."""

    use_qk_norm: bool = False
    logit_scale: float = 1.0
    rope_layers: tuple[bool, ...] = ()     # whether each layer rotates; (): every layer


class CohereLayerNorm(nn.Module):
    """weight * (x - mean) / sqrt(var + eps) over the last dim, in float32, rounded once; no
    bias (transformers' CohereLayerNorm). `shape` (heads, head_dim) for the q/k norms: this
    rank's heads, rows `start` .. of the checkpoint's [all heads, head_dim] weight."""

    def __init__(self, shape: tuple[int, ...], eps: float, dtype: torch.dtype,
                 start: int = 0) -> None:
        super().__init__()
        self.eps = eps
        self.start = start
        loader = self._rows_loader if len(shape) == 2 else default_weight_loader
        self.weight = new_param(shape, dtype, loader)

    def _rows_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = read_rows(loaded, 0, self.start, param.shape[0])
        copy_checked(param.data, rows, "per-head norm slice")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean = x32.mean(-1, keepdim=True)
        variance = (x32 - mean).pow(2).mean(-1, keepdim=True)
        x32 = (x32 - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class CohereAttention(DecoderAttention):
    """Llama's attention with Cohere's optional per-head q/k LayerNorm before rope."""

    def __init__(self, args: CohereArgs, rotary_emb: RotaryEmbedding, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype, sliding_window: int = 0) -> None:
        super().__init__(replace(args, qk_norm=False), rotary_emb, tp, backend, dtype,
                         sliding_window)
        self.use_qk_norm = args.use_qk_norm
        if self.use_qk_norm:
            d, eps = args.head_dim, args.rms_norm_eps
            self.q_norm = CohereLayerNorm((self.num_heads, d), eps, dtype,
                                          tp.rank * self.num_heads)
            self.k_norm = CohereLayerNorm((self.num_kv_heads, d), eps, dtype,
                                          self.qkv_proj.kv_head_start)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kv_in_rope:          # the rope launch also writes k/v into the cache
            return self._forward_kv_in_rope(positions, q, k, v, kv_cache, meta)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class CohereDecoderLayer(nn.Module):
    """One LayerNorm, attention and the MLP side by side: x + attn(ln(x)) + mlp(ln(x))."""

    def __init__(self, args: CohereArgs, rotary_emb: nn.Module, tp: TPGroup,
                 backend: AttentionBackend, dtype: torch.dtype, mlp: nn.Module | None = None,
                 sliding_window: int = 0) -> None:
        super().__init__()
        self.self_attn = CohereAttention(args, rotary_emb, tp, backend, dtype, sliding_window)
        self.mlp = DecoderMLP(args, tp, dtype) if mlp is None else mlp
        self.input_layernorm = CohereLayerNorm((args.hidden_size,), args.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        attn = self.self_attn(positions, normed, kv_cache, meta)
        return hidden + attn + self.mlp(normed)      # transformers' order of the two adds


class CohereModel(DecoderModel):
    """Embedding, Cohere's parallel blocks and the final LayerNorm; a layer rope_layers marks
    False (Cohere2's full layers) has no rope."""

    layer_class = CohereDecoderLayer

    def __init__(self, args: CohereArgs, *rest, **kwargs) -> None:
        self._rope_layers = args.rope_layers      # read by layer_rope, during super's init
        super().__init__(args, *rest, **kwargs)
        self.norm = CohereLayerNorm((args.hidden_size,), args.rms_norm_eps,
                                    self.norm.weight.dtype)

    def layer_rope(self, layer: int, rotary_emb: RotaryEmbedding,
                   hf_config: dict) -> nn.Module:
        flags = self._rope_layers
        return NoRope() if flags and not flags[layer] else rotary_emb

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)


class ScaledLogitsHead(ParallelLMHead):
    """The LM head, its model-dtype logits times logit_scale (transformers' order). With a
    scale other than 1 the fused greedy head is off (its logprobs would be unscaled)."""

    logit_scale: float = 1.0

    def greedy(self, hidden: torch.Tensor, logprobs: bool = True):
        return None if self.logit_scale != 1.0 else super().greedy(hidden, logprobs)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._model_dtype_logits(hidden)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        return logits.float()


def cohere_scalars(cfg: dict) -> dict:
    """layer_norm_eps and logit_scale, or ValueError naming one that is not a finite number
    (transformers would multiply the logits by None)."""
    values = {}
    for key in ("layer_norm_eps", "logit_scale"):
        value = cfg.get(key, COHERE_DEFAULTS[key])
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"config.json: {key}={value!r} is invalid: must be a finite number")
        values[key] = float(value)
    return values


class CohereForCausalLM(PairRopeCheckpoint, LlamaForCausalLM):
    """A Command-R causal LM over the paged KV cache (interface as LlamaForCausalLM's)."""

    decoder_class = CohereModel
    lm_head_class = ScaledLogitsHead
    tie_by_default = True              # CohereConfig's
    default_rope_theta = COHERE_DEFAULTS["rope_theta"]
    reads_qk_norm = True               # Cohere2Config has no use_qk_norm

    def __init__(self, hf_config: dict, tp: TPGroup, attn_backend: AttentionBackend,
                 dtype: torch.dtype, fused_ops: bool = False) -> None:
        hf_config = {"rope_theta": self.default_rope_theta, **hf_config}
        super().__init__(hf_config, tp, attn_backend, dtype, fused_ops)
        self.lm_head.logit_scale = self.args.logit_scale
        self.set_pair_rotary_dim(hf_config)

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> CohereArgs:
        refuse_activation(hf_config, type(self).__name__)
        scalars = cohere_scalars(hf_config)
        base = replace(super().decoder_args(hf_config, fused_ops), mlp_bias=False,
                       rms_norm_eps=scalars["layer_norm_eps"])
        use_qk_norm = self.reads_qk_norm and bool(hf_config.get("use_qk_norm"))
        return CohereArgs(**asdict(base), use_qk_norm=use_qk_norm,
                          logit_scale=scalars["logit_scale"])


def cohere2_layer_windows(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """Each layer's window (0: full, no rope), as Cohere2Config / Cohere2Attention read them;
    a ValueError names a bad layer_types, pattern or window. The window is read only when a
    layer slides (transformers' Cohere2Attention reads it there alone): a config whose layers
    are all full may leave it null."""
    types = _cohere2_layer_types(cfg, num_layers)
    if SLIDING not in types:
        return (0,) * num_layers
    window = cfg.get("sliding_window", COHERE_DEFAULTS["sliding_window"])
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json: sliding_window={window!r} is not supported for "
                         "Cohere2ForCausalLM with sliding_attention layers: must be a positive "
                         "integer (its sliding layers are its only rotary ones)")
    return tuple(window if t == SLIDING else 0 for t in types)


def _cohere2_layer_types(cfg: dict, num_layers: int) -> list:
    """layer_types, or Cohere2Config's from sliding_window_pattern (every pattern-th full)."""
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern", DEFAULT_PATTERN)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"config.json: sliding_window_pattern={pattern!r} is invalid: "
                             "must be a positive integer")
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers \
            or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"config.json: layer_types={types!r} is invalid: must be "
                         f"num_hidden_layers={num_layers} entries of {(SLIDING, FULL)}")
    return types


class Cohere2ForCausalLM(CohereForCausalLM):
    """A Command-R7B / Command-A causal LM: Cohere's blocks without q/k norms, sliding layers
    with rope and full layers without."""

    default_rope_theta = 10000.0       # Cohere2Config's (PreTrainedConfig's)
    reads_qk_norm = False

    @classmethod
    def layer_windows(cls, hf_config: dict, num_layers: int) -> tuple[int, ...]:
        return cohere2_layer_windows(hf_config, num_layers)

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> CohereArgs:
        args = super().decoder_args(hf_config, fused_ops)
        windows = cohere2_layer_windows(hf_config, args.num_layers)
        return replace(args, rope_layers=tuple(bool(w) for w in windows))
