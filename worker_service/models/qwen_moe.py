"""Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (models/llama.py) whose MLPs are sparse
mixture-of-experts blocks, as transformers' modeling_qwen2_moe / modeling_qwen3_moe.

Layer i is sparse when num_experts > 0, i is not in mlp_only_layers and (i + 1) is a multiple
of decoder_sparse_step; otherwise it keeps the dense MLP of width intermediate_size. A sparse
block routes each token to its top-k experts (width moe_intermediate_size; layers/moe.py).
Qwen2-MoE adds a shared expert (width shared_expert_intermediate_size) every token goes through,
scaled by sigmoid(shared_expert_gate(x)).

Under tensor parallelism the routed experts and the shared expert each yield this rank's partial
sum of the output; they are added first and all-reduced once per block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_common.model_files.moe_config import (EXPERT_FIELDS, expert_width_field, is_mixtral,
                                                  moe_config_problem)
from worker_service.layers.activation import SiluAndMul
from worker_service.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from worker_service.layers.moe import MoEExperts, TopKRouter, expert_target
from worker_service.layers.sharding import default_weight_loader, new_param
from worker_service.models.llama import LlamaForCausalLM
from worker_service.parallel_state import TPGroup


@dataclass(frozen=True)
class MoeArgs:
    """The sparse-MLP fields of a Qwen MoE (or Mixtral) config.json."""

    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: frozenset[int]
    shared_expert_intermediate_size: int      # 0: no shared expert (Qwen3-MoE)

    @classmethod
    def from_hf(cls, cfg: dict, shared_expert: bool) -> "MoeArgs":
        # transformers 5 writes num_local_experts; Hub checkpoints say num_experts
        field = "num_experts" if "num_experts" in cfg else "num_local_experts"
        num_experts = int(cfg.get(field) or 0)
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        problem = moe_config_problem(cfg)    # the names the config uses (the router says
        if problem is not None:              # num_experts); the scheduler refuses them first
            raise ValueError(f"config.json: {problem}")
        mixtral = is_mixtral(cfg)     # every layer sparse, top-k always renormalised
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_experts=num_experts,
            top_k=top_k,
            moe_intermediate_size=int(cfg[expert_width_field(cfg)]),
            norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=frozenset(int(i) for i in cfg.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=(
                int(cfg["shared_expert_intermediate_size"]) if shared_expert else 0))

    @classmethod
    def of_config(cls, cfg: dict) -> "MoeArgs | None":
        """The sparse-MLP fields of any MoE config we serve; None for a dense model."""
        if expert_width_field(cfg) not in cfg or not any(f in cfg for f in EXPERT_FIELDS):
            return None
        return cls.from_hf(cfg, "shared_expert_intermediate_size" in cfg)

    def is_sparse(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)


class SharedExpert(nn.Module):
    """down(silu(gate(x)) * up(x)) every token goes through; returns this rank's partial sum
    (down's all-reduce is left to the block, which adds the routed experts first)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup,
                 dtype: torch.dtype, fused_ops: bool) -> None:
        super().__init__()
        inter = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [inter, inter], False, tp,
                                                       dtype)
        self.down_proj = RowParallelLinear(inter, hidden_size, False, tp, dtype)
        self.act_fn = SiluAndMul(fused_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(self.act_fn(self.gate_up_proj(x)))


class SharedExpertGate(nn.Module):
    """sigmoid(x w^T) with w [1, H] replicated on every rank: the shared expert's per-token
    scale."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = new_param((1, hidden_size), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) the sigmoid-gated shared expert. Parameter names
    follow the checkpoints: mlp.gate, mlp.experts.*, mlp.shared_expert.*,
    mlp.shared_expert_gate."""

    def __init__(self, moe: MoeArgs, tp: TPGroup, dtype: torch.dtype,
                 fused_ops: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.gate = TopKRouter(moe.hidden_size, moe.num_experts, moe.top_k, moe.norm_topk_prob,
                               dtype)
        self.experts = MoEExperts(moe.num_experts, moe.hidden_size, moe.moe_intermediate_size,
                                  tp, dtype, fused_ops)
        self.shared_expert = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(moe.hidden_size,
                                              moe.shared_expert_intermediate_size, tp, dtype,
                                              fused_ops)
            self.shared_expert_gate = SharedExpertGate(moe.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            # the gate is a per-token scalar, so gating each rank's partial sum is exact
            out = out + self.shared_expert_gate(x) * self.shared_expert(x)
        return self.tp.all_reduce(out)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norm, biases per attention_bias), sparse MLPs."""

    qk_norm = True
    shared_expert = False
    # Qwen2MoeConfig's and Qwen3MoeConfig's: use_sliding_window without the key is refused too
    default_sliding_window = 4096

    @property
    def graph_capture_blocker(self) -> str | None:
        """Why CUDA decode graphs cannot capture this model (step/cuda_graphs'
        graphs_unsupported_reason reads it), or None: experts on the grouped torch path sync
        with the host (counts per expert); on the fused path (CUDA) nothing does."""
        if all(m.fused for m in self.modules() if isinstance(m, MoEExperts)):
            return None
        return "MoE experts group tokens with a host sync"

    def mlp_factory(self, hf_config: dict, tp: TPGroup,
                    dtype: torch.dtype) -> Callable[[int], nn.Module | None]:
        moe = MoeArgs.from_hf(hf_config, self.shared_expert)
        fused = self.args.fused_ops
        return lambda i: SparseMoeBlock(moe, tp, dtype, fused) if moe.is_sparse(i) else None

    @staticmethod
    def checkpoint_target(name: str):
        """Per-expert checkpoint tensors -> the stacked expert parameters (loader.target_of)."""
        return expert_target(name)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias per config's
    qkv_bias, default on; o_proj without bias; no q/k norm), sparse MLPs with a shared expert."""

    qk_norm = False
    o_bias = False
    shared_expert = True

    def __init__(self, hf_config: dict, *args, **kwargs) -> None:
        # transformers' Qwen2-MoE reads qkv_bias (default True), not attention_bias
        qkv = {"attention_bias": bool(hf_config.get("qkv_bias", True))}
        super().__init__({**hf_config, **qkv}, *args, **kwargs)
