"""Gemma 2 (Gemma2ForCausalLM: gemma-2-2b/9b/27b), as transformers' modeling_gemma2 computes it.

Gemma 2 is Gemma 3's decoder (models/gemma3.py: the sqrt(hidden)-scaled embedding, (1 + w)
RMSNorm in float32, the four sandwich norms per layer, the gelu-tanh GeGLU, the scale
query_pre_attn_scalar ** -0.5, the softcapped LM head) less the q/k norm and with one rope
table for every layer. What it adds is read here, as transformers' Gemma2Config reads it:

  - attn_logit_softcapping (default 50.0): every layer's scaled scores -> cap * tanh(s / cap)
    before the mask and softmax, on every attention backend (kernels/attention/backend.py);
  - final_logit_softcapping (default 30.0): the LM head's logits capped the same way, before
    sampling and logprobs (the head's output is what the sampler reads, as vLLM's logits
    processor applies it);
  - the layers alternate, sliding_attention first (layer i slides iff (i + 1) % 2), unless
    config.json lists layer_types; sliding_window defaults to 4096.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention.backend import AttentionBackend
from worker_service.layers.rotary import RopeSettings, RotaryEmbedding
from worker_service.models.gemma3 import Gemma3ForCausalLM
from worker_service.models.gemma3_config import (FULL, LAYER_TYPES, SLIDING, optional_cap,
                                                 refuse_unsupported)
from worker_service.models.llama import DecoderArgs, DecoderAttention
from worker_service.parallel_state import TPGroup

# transformers' Gemma2Config defaults (a config.json without the key gets these)
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_ATTN_SOFTCAP = 50.0
DEFAULT_FINAL_SOFTCAP = 30.0
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256


@dataclass(frozen=True)
class Gemma2Options:
    """The Gemma-2-specific fields, in the shape models/gemma3.py reads (Gemma3Options')."""

    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict[str, RopeSettings]          # both layer types: the one table
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return tuple(self.sliding_window if t == SLIDING else 0 for t in self.layer_types)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Gemma2Options":
        refuse_unsupported(cfg)
        num_layers = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if types is None:
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        if len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"config.json: layer_types={types} is invalid: must be "
                             f"num_hidden_layers={num_layers} entries of {LAYER_TYPES}")
        window = cfg.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        if SLIDING in types and not window:
            raise ValueError(f"config.json: sliding_window={window!r} with sliding_attention "
                             f"layers is invalid: must be a positive number of positions")
        rope = RopeSettings.from_hf_config(cfg)
        return cls(layer_types=tuple(types), sliding_window=int(window or 0),
                   rope={t: rope for t in LAYER_TYPES},
                   query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar",
                                                       DEFAULT_QUERY_PRE_ATTN_SCALAR)),
                   final_logit_softcapping=optional_cap(
                       cfg.get("final_logit_softcapping", DEFAULT_FINAL_SOFTCAP)),
                   attn_logit_softcapping=optional_cap(
                       cfg.get("attn_logit_softcapping", DEFAULT_ATTN_SOFTCAP)))


class Gemma2Attention(DecoderAttention):
    """Llama's attention with Gemma 2's scale, the layer's window and the attention softcap."""

    def __init__(self, args: DecoderArgs, opts: Gemma2Options, rotary_emb: RotaryEmbedding,
                 tp: TPGroup, backend: AttentionBackend, dtype: torch.dtype,
                 sliding_window: int) -> None:
        super().__init__(args, rotary_emb, tp, backend, dtype, sliding_window,
                         scale=opts.query_pre_attn_scalar ** -0.5,
                         softcap=opts.attn_logit_softcapping or 0.0)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """A Gemma 2 causal LM over the paged KV cache (interface as LlamaForCausalLM's)."""

    options_class = Gemma2Options
    attention_class = Gemma2Attention
