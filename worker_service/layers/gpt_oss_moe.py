"""GPT-OSS's sparse MLP block, as transformers' modeling_gpt_oss computes it.

Router: logits = x W^T + b (W [E, H], b [E], replicated); the top k logits per token, then a
softmax over those k only (in the logits' dtype) gives the routing weights.

Experts: each is a clamped SwiGLU MLP with biases,
    gate, up = x Wg^T + bg, x Wu^T + bu
    h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),  g = clamp(gate, max=limit)
    y = h Wd^T + bd
(alpha = swiglu_alpha, 1.702; limit = swiglu_limit, 7.0). The checkpoint stores the experts
stacked in transformers' layout, gate and up interleaved by column:
    gate_up_proj [E, H, 2I] (gate = columns 0::2, up = 1::2), gate_up_proj_bias [E, 2I],
    down_proj [E, I, H], down_proj_bias [E, H],
or, quantized (layers/mxfp4.py), gate_up_proj_blocks/_scales and down_proj_blocks/_scales in
place of the two weights, dequantized at load into the model's dtype. They load into
    w13_weight [E, 2 I_r, H] (this rank's gate rows, then its up rows), w13_bias [E, 2 I_r],
    w2_weight [E, H, I_r], w2_bias [E, H] (whole on every rank, added by rank 0 only),
so under tensor parallelism each rank keeps a slice I_r = I / tp of every expert and returns a
partial sum, which the block all-reduces.

On the CPU, after use_cpu_kernels() (at load), a step within kernels/cpu/moe_experts'
MAX_MEAN_ROWS takes the packed experts, as the other MoE models' experts do: the same call,
with the biases and the clamped SwiGLU. Otherwise (longer prefills, CUDA) the experts run on
the grouped torch path (one host sync for the per-expert counts, then two GEMMs per expert that
has tokens; on the CPU those GEMMs run on the panels once the parameters are let go, as
layers/moe.py's PackedExperts.expert_linear does): the fused Triton kernels compute silu(gate) *
up without biases, so they are not used for this block (the model's graph_capture_blocker says so).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import moe_experts as cpu_moe
from worker_service.layers.moe import PackedExperts
from worker_service.layers.sharding import (copy_checked, default_weight_loader, divide,
                                            loaded_shape, new_param, read_all)
from worker_service.layers.mxfp4 import dequantize_experts
from worker_service.parallel_state import TPGroup

MXFP4_PIECES = ("blocks", "scales")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssRouter(nn.Module):
    """x [T, H] -> (routing weights [T, k] in x's dtype, expert ids [T, k] int64)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} is invalid: must be in "
                             f"[1, num_local_experts={num_experts}]")
        self.top_k = top_k
        self.weight = new_param((num_experts, hidden_size), dtype, default_weight_loader)
        self.bias = new_param((num_experts,), dtype, default_weight_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class GptOssExperts(PackedExperts, nn.Module):
    """E clamped-SwiGLU experts with biases; forward returns this rank's partial sum.
    mxfp4: the checkpoint holds the two weights as MXFP4 blocks and scales."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TPGroup, dtype: torch.dtype, alpha: float, limit: float,
                 mxfp4: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.inter_per_rank = i_r = divide(intermediate_size, tp.world_size, "intermediate_size")
        self.alpha, self.limit = alpha, limit
        self.dtype = dtype
        pieces = MXFP4_PIECES if mxfp4 else None
        self.w13_weight = new_param((num_experts, 2 * i_r, hidden_size), dtype,
                                    self._weight_loader, pieces)
        self.w13_bias = new_param((num_experts, 2 * i_r), dtype, self._gate_up_bias_loader)
        self.w2_weight = new_param((num_experts, hidden_size, i_r), dtype,
                                   self._weight_loader, pieces)
        self.w2_bias = new_param((num_experts, hidden_size), dtype, default_weight_loader)
        for param, name in ((self.w13_weight, "gate_up_proj"), (self.w2_weight, "down_proj")):
            # a missing piece is reported by its checkpoint name
            param.shard_name = lambda param_name, piece, name=name: (
                f"{param_name.rsplit('.', 1)[0]}.{name}_{piece}")
        self._packed: dict[int, dict[str, torch.Tensor]] = {}   # MXFP4 pieces met so far

    # ---- loading ------------------------------------------------------------------------

    def _weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """A whole weight (transformers' layout), or one MXFP4 piece of it: the weight is
        dequantized once both its blocks and its scales have arrived. gate_up is read only
        over this rank's columns 2 s .. 2 (s + I_r) (its gate and up units, interleaved)."""
        gate_up = param is self.w13_weight
        name = "gate_up_proj" if gate_up else "down_proj"
        if shard_id is None:
            self._check(loaded, self._full_shape(gate_up), name)
            self._load_part(param, loaded[:, :, self._cols()] if gate_up else read_all(loaded))
            return
        if shard_id not in MXFP4_PIECES:
            raise ValueError(f"shard_id={shard_id!r} is invalid: must be one of {MXFP4_PIECES}")
        if not param.shard_ids:    # transformers would leave the weight random, warning only
            raise ValueError(f"{name}_{shard_id} is an MXFP4 piece, but config.json has no "
                             "quantization_config with quant_method 'mxfp4'")
        # the quantized W [E, rows, cols]: blocks [E, rows, cols / 32, 16], scales without the 16
        rows, cols = ((2 * self.intermediate_size, self.hidden_size) if gate_up
                      else (self.hidden_size, self.intermediate_size))
        packed = (self.num_experts, rows, cols // 32) + ((16,) if shard_id == "blocks" else ())
        self._check(loaded, packed, f"{name}_{shard_id}")
        pending = self._packed.setdefault(id(param), {})
        pending[shard_id] = loaded[:, self._cols()] if gate_up else read_all(loaded)
        if len(pending) == len(MXFP4_PIECES):
            del self._packed[id(param)]
            self._load_part(param, dequantize_experts(pending["blocks"], pending["scales"],
                                                      self.dtype, name))

    def _full_shape(self, gate_up: bool) -> tuple[int, int, int]:
        """transformers' gate_up_proj [E, H, 2I] or down_proj [E, I, H]."""
        e, h, inter = self.num_experts, self.hidden_size, self.intermediate_size
        return (e, h, 2 * inter) if gate_up else (e, inter, h)

    def _cols(self) -> slice:
        """This rank's gate_up columns: its I_r gate and I_r up units, interleaved."""
        start = self.tp.rank * self.inter_per_rank
        return slice(2 * start, 2 * (start + self.inter_per_rank))

    def _load_part(self, param: nn.Parameter, part: torch.Tensor) -> None:
        """This rank's gate_up columns [E, H, 2 I_r] (interleaved) or the whole down_proj
        [E, I, H] -> the stacked parameter."""
        if param is self.w13_weight:
            rows = part.transpose(1, 2)                                   # [E, 2 I_r, H]
            copy_checked(param.data, torch.cat([rows[:, 0::2], rows[:, 1::2]], 1),
                         "expert gate_up_proj")
            return
        start, size = self.tp.rank * self.inter_per_rank, self.inter_per_rank
        copy_checked(param.data, part.transpose(1, 2)[:, :, start:start + size],
                     "expert down_proj")

    def _gate_up_bias_loader(self, param: nn.Parameter, loaded: Any,
                             shard_id: Any = None) -> None:
        """gate_up_proj_bias [E, 2I] (interleaved) -> this rank's gate, then up entries."""
        self._check(loaded, (self.num_experts, 2 * self.intermediate_size), "gate_up_proj_bias")
        part = loaded[:, self._cols()]
        copy_checked(param.data, torch.cat([part[:, 0::2], part[:, 1::2]], 1),
                     "expert gate_up_proj_bias")

    @staticmethod
    def _check(loaded: Any, shape: tuple[int, ...], name: str) -> None:
        if loaded_shape(loaded) != shape:
            raise ValueError(f"experts.{name}: checkpoint shape {loaded_shape(loaded)} does not "
                             f"match the config's {shape}")

    # ---- forward ------------------------------------------------------------------------

    def use_cpu_kernels(self) -> bool:
        """Pack the experts and their biases for kernels/cpu/moe_experts (CPU weights); re-run
        after changing the weights (not after the release: the panels are the weights then;
        the biases stay parameters)."""
        if self.weights_released:
            return True
        self.cpu_experts = cpu_moe.prepare(self.w13_weight.data, self.w2_weight.data,
                                           self.w13_bias.data,
                                           self.w2_bias.data if self.tp.rank == 0 else None)
        return self.cpu_experts is not None

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> sum over each token's k experts of
        weight * expert(x), [T, H] (this rank's partial sum; the down bias on rank 0 only)."""
        if self.cpu_experts is not None and self.cpu_experts.takes(x, ids):
            return self.cpu_experts(x, weights, ids,
                                    cpu_moe.ClampedSwiGLU(self.alpha, self.limit))
        num_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)     # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # host sync
        grouped = x.index_select(0, order // top_k)
        out = torch.empty_like(grouped)
        start, i_r = 0, self.inter_per_rank
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            gate_up = self.expert_linear(grouped[rows], expert, False, self.w13_bias[expert])
            gate, up = gate_up.split(i_r, dim=-1)
            hidden = clamped_swiglu(gate, up, self.alpha, self.limit)
            bias = self.w2_bias[expert] if self.tp.rank == 0 else None
            out[rows] = self.expert_linear(hidden, expert, True, bias)
            start += n
        per_slot = torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, top_k, -1)
        return torch.bmm(weights.unsqueeze(1), per_slot).squeeze(1)


class GptOssMoeBlock(nn.Module):
    """Router and experts (checkpoint names mlp.router.*, mlp.experts.*); all-reduced output."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 tp: TPGroup, dtype: torch.dtype, alpha: float, limit: float,
                 mxfp4: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.router = GptOssRouter(hidden_size, num_experts, top_k, dtype)
        self.experts = GptOssExperts(num_experts, hidden_size, intermediate_size, tp, dtype,
                                     alpha, limit, mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.tp.all_reduce(self.experts(x, weights, ids))
