"""Mixture-of-experts layers: the top-k router and the experts of a sparse MLP block.

Routing (as transformers' Qwen2-MoE / Qwen3-MoE TopKRouter): softmax over the experts in float32,
the top-k probabilities, optionally renormalised to sum to 1, cast back to the logits' dtype.

Experts: every expert is a gated MLP down(silu(gate(x)) * up(x)). Their weights are stacked,
w13 [E, 2 * I_r, H] (this rank's gate rows, then its up rows) and w2 [E, H, I_r], so a fused
kernel could read them as they are. The batch's (token, slot) pairs are sorted by expert and each
expert that received tokens runs two GEMMs over its contiguous group: a host loop over at most E
experts, never over tokens, after one host sync (the per-expert counts).

On the CPU, after use_cpu_kernels() (at load, as the dense layers), a step whose experts get
at most kernels/cpu/moe_experts.MAX_MEAN_ROWS[dtype] rows on average takes
kernels/cpu/moe_experts.py instead: every expert's weights packed in the dense layers' decode
panels, and one C++ call per layer for the grouping, the GEMMs of the experts with tokens (all
in one parallel region), silu-and-mul and the weighted sum; longer prefills keep the grouped
torch path. Then the model lets the parameters go (PackedExperts.release_expert_weights, from
layers/cpu_kernels.py): the panels are the experts' one copy, and the grouped path runs each
expert's two GEMMs on them in place (PackedExperts.expert_linear).

On CUDA (with Triton importable) the experts take kernels/fused_moe.py instead: the grouping on
the device into fixed-size buffers and two grouped Triton GEMMs, no host sync and no shape that
depends on the routing, so CUDA graphs can capture a MoE decode step. `fused` says which path a
module takes (the weights' device, unless forced at construction: the tests force it on CPU,
where the kernels run under Triton's interpreter).

Tensor parallelism: each rank keeps a slice I_r = I / tp of every expert's intermediate dimension
(the rows of gate/up, the columns of down), so a rank's output is a partial sum over its slice;
the block that owns the experts adds its other partial sums (a shared expert) and all-reduces once.

Checkpoint names are per expert, `...mlp.experts.{e}.{gate,up,down}_proj.weight`;
`expert_target` maps them onto the stacked parameters with the shard id (e, proj), and
`expert_shard_name` maps a missing shard back to the checkpoint name the loader reports.
"""
from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import moe_experts as cpu_moe
from worker_service.layers.activation import SiluAndMul
from worker_service.layers.cpu_gemm import _stand_in
from worker_service.layers.sharding import (copy_checked, default_weight_loader, divide,
                                            new_param, read_rows)
from worker_service.parallel_state import TPGroup

EXPERT_WEIGHT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\."
                           r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
W13, W2 = "w13_weight", "w2_weight"


@lru_cache(maxsize=1)
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def expert_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """Checkpoint name of one expert's projection -> (stacked parameter name, (expert, proj));
    None for any other tensor."""
    m = EXPERT_WEIGHT.match(name)
    if m is None:
        return None
    param = W2 if m["proj"] == "down_proj" else W13
    return f"{m['prefix']}.{param}", (int(m["expert"]), m["proj"])


def expert_shard_name(param_name: str, shard_id: tuple[int, str]) -> str:
    """The checkpoint name a stacked parameter's shard is read from (for error messages)."""
    expert, proj = shard_id
    return f"{param_name.rsplit('.', 1)[0]}.{expert}.{proj}.weight"


class PackedExperts:
    """Mixin for an experts module with stacked `w13_weight` / `w2_weight` and, once packed,
    `cpu_experts`: once the panels hold the weights the parameters go, and every later read of
    an expert's weights comes from the panels."""

    cpu_experts: cpu_moe.CpuExperts | None = None
    weights_released = False

    def release_expert_weights(self) -> bool:
        """Let w13_weight and w2_weight go once packed: one-element NaNs seen as their shapes
        (cpu_gemm._stand_in: any read that bypasses expert_weights gives NaN, never a silent
        zero; a weight loader writing into them fails). False when not packed."""
        if self.cpu_experts is None or self.weights_released:
            return False
        _stand_in(self.w13_weight)
        _stand_in(self.w2_weight)
        self.weights_released = True
        return True

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2 I_r, H], w2 [H, I_r]) of one expert: views of the parameters, or after the
        release copies read back from the panels (stacked_weights; forward uses expert_linear)."""
        if self.weights_released:
            return self.cpu_experts.expert_weights(expert)
        return self.w13_weight[expert], self.w2_weight[expert]

    def expert_linear(self, x: torch.Tensor, expert: int, down: bool,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, w, bias) for one expert's w13 (w2 with `down`): the parameter, or after
        the release the panels (CpuExperts.expert_linear: no dense copy where the body reads
        them in place)."""
        if self.weights_released:
            return self.cpu_experts.expert_linear(x, expert, down, bias)
        return F.linear(x, (self.w2_weight if down else self.w13_weight)[expert], bias)

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2 I_r, H], w2 [E, H, I_r]): the parameters, or after the release a
        transient copy of every expert from the panels (only a test forcing the fused Triton
        path onto packed CPU experts needs it: on CUDA nothing is packed)."""
        if not self.weights_released:
            return self.w13_weight, self.w2_weight
        w13, w2 = zip(*(self.expert_weights(e) for e in range(self.w13_weight.shape[0])))
        return torch.stack(w13), torch.stack(w2)


class TopKRouter(nn.Module):
    """Router logits x W^T (W [E, H], replicated on every rank) -> (weights [T, k] in x's dtype,
    expert ids [T, k] int64)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} is invalid: must be in "
                             f"[1, num_experts={num_experts}]")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = new_param((num_experts, hidden_size), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class MoEExperts(PackedExperts, nn.Module):
    """E gated-MLP experts, stacked; forward returns this rank's partial sum (not reduced).
    fused_moe: None picks the fused kernels when the weights are on CUDA and Triton is
    importable; True/False forces a path."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TPGroup, dtype: torch.dtype | None = None, fused_ops: bool = False,
                 fused_moe: bool | None = None) -> None:
        super().__init__()
        self.fused_moe = fused_moe
        self.tp = tp
        self.num_experts = num_experts
        self.inter_per_rank = divide(intermediate_size, tp.world_size, "moe_intermediate_size")
        i_r = self.inter_per_rank
        ids13 = tuple((e, p) for e in range(num_experts) for p in ("gate_proj", "up_proj"))
        ids2 = tuple((e, "down_proj") for e in range(num_experts))
        self.w13_weight = new_param((num_experts, 2 * i_r, hidden_size), dtype,
                                    self.weight_loader, ids13)
        self.w2_weight = new_param((num_experts, hidden_size, i_r), dtype,
                                   self.weight_loader, ids2)
        for p in (self.w13_weight, self.w2_weight):
            p.shard_name = expert_shard_name
        self.act_fn = SiluAndMul(fused_ops)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """Copy this rank's slice of one expert's gate, up (rows) or down (columns)."""
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has "
                             f"num_experts={self.num_experts}")
        size, start = self.inter_per_rank, self.tp.rank * self.inter_per_rank
        if proj == "down_proj":
            copy_checked(param.data[expert], read_rows(loaded, 1, start, size), "expert down")
            return
        offset = 0 if proj == "gate_proj" else size
        copy_checked(param.data[expert].narrow(0, offset, size),
                     read_rows(loaded, 0, start, size), f"expert {proj}")

    def use_cpu_kernels(self) -> bool:
        """Pack the experts for kernels/cpu/moe_experts (CPU weights, unless forced onto the
        fused Triton kernels); re-run after changing the weights (not after the release: the
        panels are the weights then)."""
        if self.weights_released:
            return True
        self.cpu_experts = None if self.fused_moe else cpu_moe.prepare(self.w13_weight.data,
                                                                       self.w2_weight.data)
        return self.cpu_experts is not None

    @property
    def fused(self) -> bool:
        """Whether forward runs kernels/fused_moe.py (no host sync) rather than the grouped
        torch path."""
        if self.fused_moe is not None:
            return self.fused_moe
        return self.w13_weight.is_cuda and triton_importable()

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> sum over each token's k experts of
        weight * expert(x), [T, H] (this rank's partial sum)."""
        if self.fused:
            from kernels.fused_moe import fused_experts   # imports triton: only on this path
            return fused_experts(x, *self.stacked_weights(), weights, ids)
        if self.cpu_experts is not None and self.cpu_experts.takes(x, ids):
            return self.cpu_experts(x, weights, ids)
        top_k = ids.shape[1]
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)     # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync
        grouped = x.index_select(0, order // top_k)
        out = torch.empty_like(grouped)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            gate_up = self.expert_linear(grouped[rows], expert, down=False)
            out[rows] = self.expert_linear(self.act_fn(gate_up), expert, down=True)
            start += n
        return weighted_sum(out, order, weights)


def weighted_sum(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The grouped outputs `out` (the (token, slot) pairs in `order`) back in (token, slot)
    order, then each token's weighted sum over its k slots: a [1, k] x [k, H] product per
    token (a scatter-add over tokens is far slower on CPU)."""
    num_tokens, top_k = weights.shape
    per_slot = torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, top_k, -1)
    return torch.bmm(weights.unsqueeze(1), per_slot).squeeze(1)
