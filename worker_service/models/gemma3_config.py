"""What a Gemma 3 text config.json (model_type gemma3_text) asks for, read as transformers 5's
Gemma3TextConfig reads it: the layer types, each layer's sliding window and the two rope tables.

Both config layouts are read:
  - Hub checkpoints (transformers 4.5x): `rope_theta` (full layers, default 1e6),
    `rope_local_base_freq` (sliding layers, default 1e4), `rope_scaling` (full layers only,
    e.g. linear factor 8 on the 4B+ models) and `sliding_window_pattern` (every 6th layer full)
    instead of `layer_types`;
  - transformers 5: `rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}`
    and `layer_types`.

Refused rather than approximated: attention logit softcapping (null on every Hub checkpoint;
transformers 5's Gemma3Attention reads it but never applies it, vLLM applies it: the two
references disagree, so neither is picked), bidirectional attention (Gemma 3 embedding
models), another MLP activation than gelu_pytorch_tanh, and a sliding layer without a window.
"""
from __future__ import annotations

from dataclasses import dataclass

from worker_service.layers.rotary import RopeSettings

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
# transformers' Gemma3TextConfig defaults
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_PATTERN = 6
DEFAULT_HEAD_DIM = 256          # Gemma2Config's and Gemma3TextConfig's
ACTIVATION = "gelu_pytorch_tanh"
# the lengths a scaled rope reads (rope_config.py); not a top-level original_max_position_embeddings:
# transformers standardizes nested (per layer type) rope dicts with setdefault, so each type's
# own value, else max_position_embeddings, is its original length
LENGTH_KEYS = ("architectures", "max_position_embeddings")


@dataclass(frozen=True)
class Gemma3Options:
    """The Gemma-specific fields; the shapes are read by DecoderArgs.from_hf."""

    layer_types: tuple[str, ...]
    sliding_window: int
    rope: dict[str, RopeSettings]          # layer type -> its rope table's settings
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None = None     # always None for Gemma 3 (refused)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return tuple(self.sliding_window if t == SLIDING else 0 for t in self.layer_types)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Gemma3Options":
        refuse_unsupported(cfg)
        if cfg.get("attn_logit_softcapping"):
            raise ValueError(f"config.json: attn_logit_softcapping="
                             f"{cfg['attn_logit_softcapping']} is not supported for Gemma 3: "
                             f"transformers' Gemma3 ignores it and vLLM applies it (the Hub "
                             f"checkpoints set it to null)")
        types = layer_types(cfg)
        window = cfg.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        if SLIDING in types and not window:
            raise ValueError(f"config.json: sliding_window={window!r} with sliding_attention "
                             f"layers is invalid: must be a positive number of positions")
        return cls(layer_types=types, sliding_window=int(window or 0),
                   rope=rope_settings(cfg),
                   query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                   final_logit_softcapping=optional_cap(cfg.get("final_logit_softcapping")))


def optional_cap(value) -> float | None:
    """A softcap field: null or 0 is none, else a positive number."""
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"config.json: softcapping={value!r} is invalid: must be a positive "
                         f"number or null")
    return float(value)


def refuse_unsupported(cfg: dict) -> None:
    """ValueError for what Gemma 2 and 3 configs may ask that is not implemented."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention=true is not supported: the "
                         "attention backends are causal")
    act = cfg.get("hidden_activation") or ACTIVATION
    if act != ACTIVATION:
        raise ValueError(f"config.json: hidden_activation={act!r} is not supported: must be "
                         f"{ACTIVATION!r}")


def layer_types(cfg: dict) -> tuple[str, ...]:
    """Each layer's type: `layer_types`, or without it every `sliding_window_pattern`-th layer
    (1-based) full and the rest sliding, as Gemma3TextConfig derives it."""
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", DEFAULT_PATTERN))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries: must have "
                         f"num_hidden_layers={num_layers}")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"config.json: layer_types {unknown} are not supported: must be one "
                         f"of {LAYER_TYPES}")
    return tuple(types)


def rope_settings(cfg: dict) -> dict[str, RopeSettings]:
    """Layer type -> rope settings. Sliding layers: rope_local_base_freq, no scaling; full
    layers: rope_theta with rope_scaling (Gemma3TextConfig.convert_rope_params_to_dict)."""
    params = cfg.get("rope_parameters")
    if params is not None and not set(params) <= set(LAYER_TYPES):
        raise ValueError(f"config.json: rope_parameters={params} is not supported for Gemma 3: "
                         f"must be nested by layer type ({', '.join(LAYER_TYPES)})")
    params = {t: dict((params or {}).get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    if cfg.get("rope_scaling"):
        params[FULL].update(cfg["rope_scaling"])
    params[FULL].setdefault("rope_theta", cfg.get("rope_theta") or DEFAULT_THETA[FULL])
    params[SLIDING].setdefault("rope_theta",
                               cfg.get("rope_local_base_freq") or DEFAULT_THETA[SLIDING])
    # the lengths a scaled rope reads (rope_config.py) come along
    lengths = {k: cfg[k] for k in LENGTH_KEYS if k in cfg}
    return {t: RopeSettings.from_hf_config({**lengths, "rope_parameters": params[t]})
            for t in LAYER_TYPES}
