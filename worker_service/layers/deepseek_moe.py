"""DeepSeek's MoE routers, as transformers' modeling_deepseek_v2 / modeling_deepseek_v3.

Routers (router logits x W^T in float32, W [E, H] kept in float32 as transformers keeps it):

  V2 (sigmoid False)  scores = softmax(logits);
        topk_method "greedy":               the top-k scores;
        topk_method "group_limited_greedy": the experts split into n_group groups, each scored
                                            by its best expert; the topk_group best groups kept
                                            (the others' scores set to 0), then the top-k;
        weights = those scores * routed_scaling_factor.
  V3 (sigmoid True, "noaux_tc")  scores = sigmoid(logits); choice = scores +
        e_score_correction_bias; each group scored by the sum of its two best choices; the
        topk_group best groups kept (the others' choices -inf); the top-k choices; weights =
        their scores (without the bias), divided by their sum (+ 1e-20) when norm_topk_prob,
        times routed_scaling_factor.

The block around the router (routed experts on layers/moe.py's MoEExperts, the shared
experts) is models/deepseek.py's DeepseekMoeBlock.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.layers.sharding import default_weight_loader, new_param

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class RoutingArgs:
    """How a DeepSeek router picks a token's experts (see the module docstring)."""

    num_experts: int
    top_k: int
    sigmoid: bool                 # V3's sigmoid + correction bias; False: V2's softmax
    grouped: bool                 # pick topk_group of n_group groups first
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok={self.top_k} is invalid: must "
                             f"be in [1, n_routed_experts={self.num_experts}]")
        if not self.grouped:
            return
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"config.json: n_group={self.n_group} is invalid: must be >= 1 "
                             f"and divide n_routed_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"config.json: topk_group={self.topk_group} is invalid: must be "
                             f"in [1, n_group={self.n_group}]")
        per_group = self.num_experts // self.n_group
        if self.topk_group * per_group < self.top_k:
            raise ValueError(f"config.json: num_experts_per_tok={self.top_k} is invalid: "
                             f"must be <= topk_group * experts per group = "
                             f"{self.topk_group * per_group}")
        if self.sigmoid and per_group < 2:
            raise ValueError(f"config.json: n_group={self.n_group} is invalid: each group "
                             f"is scored by its two best experts, so n_routed_experts / "
                             f"n_group must be >= 2")


def _keep_best_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int,
                      fill: float) -> torch.Tensor:
    """scores [T, E] with every expert outside the topk_group best groups set to `fill`."""
    num_tokens, n_group = group_scores.shape
    best = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep.unsqueeze(-1).expand(-1, -1, scores.shape[-1] // n_group)
    return scores.masked_fill(~keep.reshape(num_tokens, -1), fill)


class DeepseekRouter(nn.Module):
    """x [T, H] -> (weights [T, k] float32, expert ids [T, k] int64); V2's or V3's rule."""

    def __init__(self, hidden_size: int, routing: RoutingArgs) -> None:
        super().__init__()
        self.routing = routing
        self.weight = new_param((routing.num_experts, hidden_size), torch.float32,
                                default_weight_loader)
        if routing.sigmoid:
            self.e_score_correction_bias = new_param((routing.num_experts,), torch.float32,
                                                     default_weight_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        if self.routing.sigmoid:
            weights, ids = self._sigmoid_topk(logits)
        else:
            weights, ids = self._softmax_topk(logits)
        return weights * self.routing.routed_scaling_factor, ids

    def _grouped(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.view(scores.shape[0], self.routing.n_group, -1)

    def _softmax_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        scores = logits.softmax(dim=-1)
        if r.grouped:
            group_scores = self._grouped(scores).max(dim=-1).values
            scores = _keep_best_groups(scores, group_scores, r.topk_group, 0.0)
        return torch.topk(scores, k=r.top_k, dim=-1, sorted=False)

    def _sigmoid_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if r.grouped:
            group_scores = self._grouped(choice).topk(2, dim=-1)[0].sum(dim=-1)
            choice = _keep_best_groups(choice, group_scores, r.topk_group, float("-inf"))
        ids = torch.topk(choice, k=r.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids
