"""A DeepSeek-V2 / V3 config.json read as transformers reads it (DeepseekV2Config /
DeepseekV3Config: their defaults for absent keys), into the attention (layers/mla.py), routing
(layers/deepseek_moe.py) and sparse-layer fields the model builds from.

Which layers are sparse: layer i >= first_k_dense_replace with i % moe_layer_freq == 0, as
DeepSeek's own modeling code and vLLM read it (transformers 5 ignores moe_layer_freq; every
released checkpoint has 1, where the readings agree).

Refused by name rather than run differently from transformers: a V2 config with norm_topk_prob
true (transformers ignores it, DeepSeek's code renormalises without routed_scaling_factor, vLLM
renormalises and scales; no released V2 sets it), a topk_method / scoring_func other than the
one the class computes (V2: greedy or group_limited_greedy with softmax; V3: noaux_tc with
sigmoid), a hidden_act other than silu, mlp_bias (the shared experts have no bias) and a
head_dim other than qk_rope_head_dim (transformers sizes its rope table by it and fails).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from worker_service.layers.deepseek_moe import V2_TOPK_METHODS, RoutingArgs
from worker_service.layers.mla import MlaArgs, mla_softmax_scale
from worker_service.layers.rotary import RopeSettings
from worker_service.models.causal_lm import refuse_activation

# transformers 5.x's config class defaults for the keys we read
V2_DEFAULTS = MappingProxyType({
    "first_k_dense_replace": 0, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_group": None,
    "topk_group": None, "topk_method": "greedy", "norm_topk_prob": False,
    "moe_intermediate_size": 1407, "num_experts_per_tok": None, "max_position_embeddings": 2048,
})
V3_DEFAULTS = MappingProxyType({
    "first_k_dense_replace": 3, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_group": 8,
    "topk_group": 4, "norm_topk_prob": True, "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8, "rope_interleave": True, "max_position_embeddings": 4096,
})


def with_defaults(hf_config: dict, v3: bool) -> dict:
    """config.json with the config class's default for every absent key we read (a present
    null stays null: q_lora_rank null means q_proj)."""
    return {**(V3_DEFAULTS if v3 else V2_DEFAULTS), **hf_config}


def _positive(cfg: dict, key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: {key}={value!r} is invalid: must be an integer >= 1")
    return value


@dataclass(frozen=True)
class SparseLayers:
    """Which layers are sparse, and their experts' widths."""

    num_layers: int
    first_k_dense_replace: int
    moe_layer_freq: int
    moe_intermediate_size: int
    n_shared_experts: int

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


def read_sparse_layers(cfg: dict) -> SparseLayers:
    first = cfg.get("first_k_dense_replace")   # null: transformers and DeepSeek's code fail
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"config.json: first_k_dense_replace={first!r} is invalid: must be an "
                         "integer >= 0")
    shared = cfg.get("n_shared_experts") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError(f"config.json: n_shared_experts={shared!r} is invalid: must be an "
                         "integer >= 0")
    return SparseLayers(num_layers=_positive(cfg, "num_hidden_layers"),
                        first_k_dense_replace=first,
                        moe_layer_freq=_positive({"moe_layer_freq": 1, **cfg}, "moe_layer_freq"),
                        moe_intermediate_size=_positive(cfg, "moe_intermediate_size"),
                        n_shared_experts=shared)


def _refuse_other(cfg: dict, key: str, allowed: tuple[str, ...], arch: str) -> None:
    value = cfg.get(key)
    if value is not None and value not in allowed:
        raise ValueError(f"config.json: {key}={value!r} is not supported for {arch}: must be "
                         f"one of {allowed}")


def read_routing(cfg: dict, v3: bool) -> RoutingArgs:
    """The router's rule from a config with defaults (with_defaults)."""
    arch = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
    _refuse_other(cfg, "topk_method", ("noaux_tc",) if v3 else V2_TOPK_METHODS, arch)
    _refuse_other(cfg, "scoring_func", ("sigmoid",) if v3 else ("softmax",), arch)
    norm = bool(cfg.get("norm_topk_prob"))
    if norm and not v3:
        raise ValueError("config.json: norm_topk_prob=True is not supported for "
                         "DeepseekV2ForCausalLM (transformers ignores it and DeepSeek's code "
                         "renormalises; the two disagree): must be false")
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
    groups = {k: _positive(cfg, k) for k in ("n_group", "topk_group")} if grouped else {}
    scaling = cfg.get("routed_scaling_factor")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or scaling <= 0:
        raise ValueError(f"config.json: routed_scaling_factor={scaling!r} is invalid: must be "
                         "a number > 0")
    return RoutingArgs(num_experts=_positive(cfg, "n_routed_experts"),
                       top_k=_positive(cfg, "num_experts_per_tok"), sigmoid=v3,
                       grouped=grouped, n_group=groups.get("n_group", 1),
                       topk_group=groups.get("topk_group", 1), norm_topk_prob=norm,
                       routed_scaling_factor=float(scaling))


def _q_lora_rank(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: q_lora_rank={value!r} is invalid: must be null (q_proj) "
                         "or an integer >= 1")
    return value


def read_mla(cfg: dict, v3: bool) -> MlaArgs:
    """The attention fields; the rope dims interleaved always on V2, per rope_interleave on V3."""
    arch = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
    refuse_activation(cfg, arch)
    if cfg.get("mlp_bias"):
        raise ValueError(f"config.json: mlp_bias=True is not supported for {arch}: must be "
                         "false")
    q_lora = cfg.get("q_lora_rank")
    nope, rope = _positive(cfg, "qk_nope_head_dim"), _positive(cfg, "qk_rope_head_dim")
    if rope % 2:
        raise ValueError(f"config.json: qk_rope_head_dim={rope} is invalid: must be even")
    head_dim = cfg.get("head_dim")      # transformers' rope table is head_dim wide when set
    if head_dim is not None and head_dim != rope:
        raise ValueError(f"config.json: head_dim={head_dim!r} is invalid for {arch}: must be "
                         f"absent or qk_rope_head_dim={rope} (the rope's width)")
    return MlaArgs(hidden_size=_positive(cfg, "hidden_size"),
                   num_heads=_positive(cfg, "num_attention_heads"),
                   q_lora_rank=0 if q_lora is None else _q_lora_rank(q_lora),
                   kv_lora_rank=_positive(cfg, "kv_lora_rank"), qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope, v_head_dim=_positive(cfg, "v_head_dim"),
                   attention_bias=bool(cfg.get("attention_bias")),
                   rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
                   scale=mla_softmax_scale(nope + rope, RopeSettings.from_hf_config(cfg)))
