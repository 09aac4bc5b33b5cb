"""GPT-OSS (GptOssForCausalLM: openai/gpt-oss-20b, -120b), as transformers' modeling_gpt_oss
computes it: the Llama-family decoder (models/llama.py) with

  - q/k/v/o projections with biases (attention_bias, True by default);
  - attention sinks: a learned logit per query head (self_attn.sinks) that joins each softmax's
    denominator (kernels/attention/backend.py), on every backend that supports them;
  - sliding and full attention per layer_types (default: alternating, sliding first), window
    sliding_window (128 by default);
  - every MLP a sparse block (layers/gpt_oss_moe.py): a router with bias, a softmax over the
    top-k logits, clamped-SwiGLU experts with biases; MXFP4 experts (quantization_config
    quant_method "mxfp4") dequantized at load (layers/mxfp4.py).

A config.json without rope_parameters/rope_scaling gets GptOssConfig's default rope (yarn,
factor 32 over 4096 positions, theta 150000), as transformers reads it, rather than a plain rope.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from engine_common.model_files.quant_config import is_mxfp4, quantization_problem
from worker_service.layers.gpt_oss_moe import GptOssMoeBlock
from worker_service.layers.sharding import copy_checked, read_rows
from worker_service.models.llama import (DecoderAttention, DecoderLayer, DecoderModel,
                                         LlamaForCausalLM)
from worker_service.parallel_state import TPGroup

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' GptOssConfig defaults (a config.json without the key gets these)
DEFAULT_SLIDING_WINDOW = 128
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0
EXPERT_PARAMS = {"gate_up_proj": "w13_weight", "gate_up_proj_bias": "w13_bias",
                 "down_proj": "w2_weight", "down_proj_bias": "w2_bias"}


def with_config_defaults(cfg: dict) -> dict:
    """config.json with GptOssConfig's defaults where transformers would fill them in: the
    biases on, the yarn rope and its theta."""
    cfg = {**cfg, "attention_bias": cfg.get("attention_bias", True)}
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        cfg["rope_parameters"] = dict(DEFAULT_ROPE)
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" not in params and cfg.get("rope_theta") is None:
        cfg["rope_theta"] = DEFAULT_ROPE_THETA
    return cfg


class GptOssAttention(DecoderAttention):
    """DecoderAttention with this rank's query heads' sink logits (checkpoint self_attn.sinks,
    [num_attention_heads], split by head as the q projection is)."""

    has_sinks = True

    def __init__(self, args, rotary_emb, tp: TPGroup, backend, dtype: torch.dtype,
                 sliding_window: int = 0) -> None:
        super().__init__(args, rotary_emb, tp, backend, dtype, sliding_window)
        self.tp_rank = tp.rank
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)
        self.sinks.weight_loader = self._sinks_loader
        self.sinks.shard_ids = None

    def attention_sinks(self) -> torch.Tensor:
        return self.sinks

    def _sinks_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        start = self.tp_rank * self.num_heads
        copy_checked(param.data, read_rows(loaded, 0, start, self.num_heads), "sinks")


class GptOssDecoderLayer(DecoderLayer):
    attention_class = GptOssAttention


class GptOssDecoderModel(DecoderModel):
    layer_class = GptOssDecoderLayer


def swiglu_constant(cfg: dict, key: str, default: float) -> float:
    """swiglu_alpha / swiglu_limit as a float (absent: GptOssConfig's default), or a ValueError
    naming it. null is refused as transformers refuses it (GptOssConfig's strict float field:
    no limit is not a value it has; its clamp(max=None) would fail too); so are NaN, booleans
    and strings. An integer is read as its float (transformers is stricter there)."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"config.json: {key}={value!r} is invalid for GptOssForCausalLM: must "
                         f"be a number (GptOssConfig's float; absent: {default})")
    return float(value)


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS: biased attention with sinks, alternating windows, every MLP sparse."""

    expert_biases = True        # memory_fit: the CPU packed experts keep float32 bias copies
    decoder_class = GptOssDecoderModel
    attention_sinks = True         # the backend selector skips backends without them

    def __init__(self, hf_config: dict, *args, **kwargs) -> None:
        problem = quantization_problem(hf_config)
        if problem is not None:
            raise ValueError(f"config.json: {problem}")
        super().__init__(with_config_defaults(hf_config), *args, **kwargs)

    @property
    def graph_capture_blocker(self) -> str | None:
        """Why CUDA decode graphs cannot capture this model (step/cuda_graphs reads it)."""
        return "GPT-OSS experts group tokens with a host sync (grouped torch path)"

    @classmethod
    def layer_windows(cls, hf_config: dict, num_layers: int) -> tuple[int, ...]:
        """layer_types (default: sliding iff (i + 1) % 2, GptOssConfig's rule); sliding layers
        get sliding_window (absent: 128; null: none)."""
        window = int(hf_config.get("sliding_window", DEFAULT_SLIDING_WINDOW) or 0)
        types = hf_config.get("layer_types")
        if types is None:
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        if not isinstance(types, list) or len(types) != num_layers \
                or not set(types) <= {SLIDING, FULL}:
            raise ValueError(f"config.json: layer_types={types!r} is invalid: must list "
                             f"num_hidden_layers={num_layers} entries, each {SLIDING!r} or "
                             f"{FULL!r}")
        return tuple(window if t == SLIDING else 0 for t in types)

    def mlp_factory(self, hf_config: dict, tp: TPGroup,
                    dtype: torch.dtype) -> Callable[[int], nn.Module | None]:
        experts = int(hf_config.get("num_local_experts") or hf_config.get("num_experts") or 0)
        if experts < 1:
            raise ValueError(f"config.json: num_local_experts={experts} is invalid: must be >= 1")
        args = (int(hf_config["hidden_size"]), experts, int(hf_config["num_experts_per_tok"]),
                int(hf_config["intermediate_size"]), tp, dtype,
                swiglu_constant(hf_config, "swiglu_alpha", DEFAULT_SWIGLU_ALPHA),
                swiglu_constant(hf_config, "swiglu_limit", DEFAULT_SWIGLU_LIMIT),
                is_mxfp4(hf_config))
        return lambda i: GptOssMoeBlock(*args)

    @staticmethod
    def checkpoint_target(name: str):
        """mlp.experts.{gate_up_proj,down_proj}[_bias|_blocks|_scales] -> the stacked expert
        parameters (an MXFP4 piece's shard id says which half it is); None otherwise."""
        prefix, sep, leaf = name.rpartition(".experts.")
        if not sep:
            return None
        for suffix in ("_blocks", "_scales"):
            if leaf.endswith(suffix) and leaf[:-len(suffix)] in ("gate_up_proj", "down_proj"):
                param = EXPERT_PARAMS[leaf[:-len(suffix)]]
                return f"{prefix}.experts.{param}", suffix[1:]
        if leaf in EXPERT_PARAMS:
            return f"{prefix}.experts.{EXPERT_PARAMS[leaf]}", None
        return None
