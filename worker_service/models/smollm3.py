"""SmolLM3 (SmolLM3ForCausalLM: HuggingFaceTB/SmolLM3-3B), as transformers' modeling_smollm3
computes it: Llama's decoder (models/llama.py) in which some layers have no position embedding
(NoPE), their q and k attended unrotated:

  - `no_rope_layers[i]` 1: layer i rotates (the model's one rope table, any rope type), 0: NoPE;
    without the list, every `no_rope_layer_interval`-th layer (4 by default, counted from 1) is
    NoPE, as SmolLM3Config derives it (SmolLM3-3B: 36 layers, 3, 7, ..., 35 NoPE);
  - a sliding window only with use_sliding_window and a sliding_window, on the layers
    layer_types marks sliding_attention (without layer_types: the NoPE layers), as
    SmolLM3Config and SmolLM3Attention; the released checkpoints have it off. layer_types
    marking sliding layers without use_sliding_window is refused: transformers would mask
    those layers with a window its attention was not given;
  - the LM head tied to the embedding unless tie_word_embeddings is false (SmolLM3Config's
    default is true, LlamaConfig's false); the MLP is SiLU-gated (another hidden_act refused).

LoRA: lora/families.py.
"""
from __future__ import annotations

from torch import nn

from worker_service.layers.rotary import NoRope, RotaryEmbedding
from worker_service.models.causal_lm import refuse_activation
from worker_service.models.llama import DecoderArgs, DecoderModel, LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_INTERVAL = 4          # SmolLM3Config's no_rope_layer_interval


def rope_layers(cfg: dict) -> tuple[bool, ...]:
    """Whether each layer rotates: no_rope_layers (1/0 per layer), or without it every
    no_rope_layer_interval-th layer NoPE; a ValueError names a bad field."""
    num_layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", DEFAULT_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json: no_rope_layer_interval={interval!r} is invalid: "
                             "must be a positive integer")
        return tuple((i + 1) % interval != 0 for i in range(num_layers))
    if (not isinstance(flags, list) or len(flags) != num_layers
            or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
        raise ValueError(f"config.json: no_rope_layers={flags!r} is invalid: must be "
                         f"num_hidden_layers={num_layers} entries of 1 (rope) or 0 (NoPE)")
    return tuple(bool(f) for f in flags)


def smollm3_layer_windows(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """Each layer's window (0: none), as SmolLM3Config / SmolLM3Attention."""
    types = cfg.get("layer_types")
    window = int(cfg.get("sliding_window") or 0)
    use = bool(cfg.get("use_sliding_window")) and window > 0
    if types is None:
        ropes = rope_layers(cfg)
        types = [SLIDING if use and not rope else FULL for rope in ropes]
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"config.json: layer_types={types!r} is invalid: must be "
                         f"num_hidden_layers={num_layers} entries of {(SLIDING, FULL)}")
    if SLIDING in types and not use:
        raise ValueError("config.json: layer_types marks sliding_attention layers but "
                         f"use_sliding_window={cfg.get('use_sliding_window')!r} / sliding_window="
                         f"{cfg.get('sliding_window')!r}: must turn the window on, or mark every "
                         "layer full_attention")
    return tuple(window if t == SLIDING else 0 for t in types)


class SmolLM3Model(DecoderModel):
    """Llama's decoder with NoPE layers (their rope a pass-through)."""

    def layer_rope(self, layer: int, rotary_emb: RotaryEmbedding, hf_config: dict) -> nn.Module:
        return rotary_emb if rope_layers(hf_config)[layer] else NoRope()


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """A SmolLM3 causal LM over the paged KV cache (interface as LlamaForCausalLM's)."""

    decoder_class = SmolLM3Model
    tie_by_default = True              # SmolLM3Config's

    def decoder_args(self, hf_config: dict, fused_ops: bool) -> DecoderArgs:
        refuse_activation(hf_config, type(self).__name__)
        rope_layers(hf_config)           # refused before any module is built
        return super().decoder_args(hf_config, fused_ops)

    @classmethod
    def layer_windows(cls, hf_config: dict, num_layers: int) -> tuple[int, ...]:
        return smollm3_layer_windows(hf_config, num_layers)
