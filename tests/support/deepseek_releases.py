"""Tiny DeepSeek-family models whose config.json carries the key set and the routing / rope
values of a released checkpoint (sizes shrunk, lengths scaled down so short prompts pass
original_max_position_embeddings): what the release-shaped tests load into both us and
transformers.

Values as released (config.json of each repository):
  DeepSeek-V2-Lite   q_lora_rank null, greedy softmax routing, n_group / topk_group 1, 2 shared
                     experts, yarn factor 40 with mscale = mscale_all_dim = 0.707
  DeepSeek-V2 / V2.5 q LoRA, group_limited_greedy (n_group 8, topk_group 3), routed_scaling
                     16.0, 6 of 160 experts, the same yarn
  DeepSeek-V3 / R1   noaux_tc sigmoid over 8 groups (4 kept), norm_topk_prob, routed_scaling
                     2.5, yarn factor 40 with mscale = mscale_all_dim = 1.0, rope_interleave
                     absent (true)
  Moonlight-16B-A3B  V3's class, q_lora_rank null, n_group / topk_group 1, routed_scaling
                     2.446, rope_theta 50000, no rope scaling
  Kimi-K2            V3's class, n_group / topk_group 1, routed_scaling 2.827, rope_theta
                     50000, yarn factor 32 with beta_fast 1, beta_slow 1
The rope scaling is written the released way (rope_scaling with "type", rope_theta at the top).
"""
from __future__ import annotations

import json
from pathlib import Path

from worker_service.models.tiny_model import make_tiny_model

ORIGINAL = 32          # original_max_position_embeddings, scaled down from 4096


def _yarn(factor: float, mscale: float, beta_fast: int = 32) -> dict:
    return {"type": "yarn", "factor": factor, "mscale": mscale, "mscale_all_dim": mscale,
            "original_max_position_embeddings": ORIGINAL, "beta_fast": beta_fast,
            "beta_slow": 1}


COMMON = {"moe_layer_freq": 1, "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
          "num_key_value_heads": 4, "hidden_act": "silu", "attention_bias": False,
          "first_k_dense_replace": 1}
RELEASES = {
    "v2-lite": ("deepseek_v2", {
        "q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 6, "n_shared_experts": 2,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "norm_topk_prob": False,
        "rope_theta": 10000, "rope_scaling": _yarn(40, 0.707),
        "max_position_embeddings": ORIGINAL * 40}),
    "v2": ("deepseek_v2", {
        "q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 8,
        "topk_group": 3, "n_routed_experts": 16, "num_experts_per_tok": 6,
        "n_shared_experts": 2, "routed_scaling_factor": 16.0, "scoring_func": "softmax",
        "norm_topk_prob": False, "rope_theta": 10000, "rope_scaling": _yarn(40, 0.707),
        "max_position_embeddings": ORIGINAL * 40}),
    "v3": ("deepseek_v3", {
        "q_lora_rank": 24, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "n_routed_experts": 16, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "norm_topk_prob": True,
        "rope_theta": 10000, "rope_scaling": _yarn(40, 1.0), "num_nextn_predict_layers": 1,
        "max_position_embeddings": ORIGINAL * 40}),
    "moonlight": ("deepseek_v3", {
        "q_lora_rank": None, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 6, "n_shared_experts": 2,
        "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "norm_topk_prob": True,
        "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 8192,
        "num_nextn_predict_layers": 0}),
    "kimi-k2": ("deepseek_v3", {
        "q_lora_rank": 24, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "n_routed_experts": 12, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "norm_topk_prob": True,
        "rope_theta": 50000.0, "rope_scaling": _yarn(32, 1.0, beta_fast=1),
        "max_position_embeddings": ORIGINAL * 32}),
}


def make_release_model(out_dir, release: str, **changes) -> str:
    """A tiny model of `release` (a RELEASES key) with its config.json as that release writes
    it (plus `changes`)."""
    arch, values = RELEASES[release]
    config = {**COMMON, **values, **changes}
    built = {k: v for k, v in config.items() if k not in ("rope_scaling", "rope_theta")}
    path = make_tiny_model(out_dir, arch=arch, seed=3, **built)
    written = json.loads((Path(path) / "config.json").read_text())
    written.pop("rope_parameters", None)
    written.update(config)
    (Path(path) / "config.json").write_text(json.dumps(written, indent=1))
    return str(path)
