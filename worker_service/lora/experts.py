"""Routed MoE experts with LoRA adapters (docs/lora.md, "MoE experts"): each (token, slot)
pair sent to expert e by a token of adapter s gets
    h = act(x W13_e^T + (x A13_{s,e}^T) B13_{s,e}^T),  y = h W2_e^T + (h A2_{s,e}^T) B2_{s,e}^T,
the scaling folded into the B stacks (expert_weights.py). The delta is added to the expert's
outputs, never merged into its weights: once packed for the CPU kernels (layers/moe.py) the
weights live only in the kernels' panels, and one step mixes adapters and the base model.

A step with no adapter row on this layer's adapted experts runs the base module unchanged (the
packed C++ kernel included). Otherwise the adapted pairs (a token's adapter touches that
expert) take the grouped torch path: sorted by expert, then by slot, so each expert runs its
two GEMMs once over its rows and each adapter's delta over a contiguous run of them. The
other pairs: where the packed kernel takes the step (or the fused Triton kernels run, on CUDA)
and at most half the pairs are adapted, one kernel call over every pair with the adapted
pairs' weights zeroed (a few adapter rows in
a decode batch keep the kernel: the grouped path reads every expert's panels, a dense copy of
each where bf16 panels cannot be read in place); else they join the grouped path as slot -1.
Under tensor parallelism the stacks hold this rank's slice (gate/up rows, down columns) and
the output stays a partial sum, reduced with the base's by the block.
"""
from __future__ import annotations

import torch
from torch import nn

from worker_service.layers.moe import MoEExperts, weighted_sum


class LoRAExperts(nn.Module):
    """A MoEExperts plus every adapter's expert stacks (expert_weights.expert_stacks)."""

    def __init__(self, base: MoEExperts, state, a13: torch.Tensor, b13: torch.Tensor,
                 a2: torch.Tensor, b2: torch.Tensor, has: torch.Tensor) -> None:
        super().__init__()
        self.base, self.state = base, state
        self.set_stacks(a13, b13, a2, b2, has)

    def set_stacks(self, a13, b13, a2, b2, has) -> None:
        """New tensors (a step still on the device keeps reading the old ones)."""
        self.a13, self.b13, self.a2, self.b2, self.has = a13, b13, a2, b2, has
        self.touched = has.any(dim=1).tolist()            # per slot: any expert of this layer

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
        slots = self.state.slots_tensor()
        if slots is None or not any(self.touched[s] for s, _ in self.state.segments):
            return self.base(x, weights, ids)
        pair = self._pair_slots(slots, ids)
        top_k, cpu = ids.shape[1], self.base.cpu_experts
        tokens = torch.arange(pair.shape[0], device=x.device) // top_k
        if not (self.base.fused or (cpu is not None and cpu.takes(x, ids))):
            out, order = self._grouped(x, ids.reshape(-1), pair, tokens)
            return weighted_sum(out, order, weights)
        adapted = pair >= 0
        num_adapted = int(adapted.sum())                    # a host sync
        if num_adapted == 0:
            return self.base(x, weights, ids)
        if 2 * num_adapted > pair.shape[0]:                 # mostly adapted: all grouped
            out, order = self._grouped(x, ids.reshape(-1), pair, tokens)
            return weighted_sum(out, order, weights)
        y = self.base(x, weights.masked_fill(adapted.view_as(weights), 0), ids)
        sel = adapted.nonzero().squeeze(1)
        out, order = self._grouped(x, ids.reshape(-1)[sel], pair[sel], tokens[sel])
        pairs = sel[order]
        scaled = out * weights.reshape(-1)[pairs].unsqueeze(1)
        return y.index_add_(0, tokens[pairs], scaled)

    def _pair_slots(self, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The adapter slot of every (token, slot) pair, -1 where the token has none or its
        adapter leaves that expert alone. Rows past the step's tokens (padding) have none."""
        num_tokens, top_k = ids.shape
        if slots.shape[0] < num_tokens:
            slots = torch.cat([slots, slots.new_full((num_tokens - slots.shape[0],), -1)])
        pair = slots[:num_tokens].repeat_interleave(top_k)
        flat = ids.reshape(-1)
        adapted = self.has[pair.clamp(min=0), flat] & (pair >= 0)
        return torch.where(adapted, pair, torch.full_like(pair, -1))

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, pair: torch.Tensor,
                 tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs of the pairs (expert ids, adapter slots, token rows), sorted by expert
        then slot, and the sorting order."""
        base = self.base
        groups = self.has.shape[0] + 1
        key = experts * groups + pair + 1
        order = torch.argsort(key, stable=True)          # by expert, then by slot (-1 first)
        counts = torch.bincount(key, minlength=base.num_experts * groups)
        counts = counts.view(base.num_experts, groups).tolist()      # the one host sync
        grouped = x.index_select(0, tokens[order])
        out = torch.empty_like(grouped)
        start = 0
        for expert, per_slot in enumerate(counts):
            n = sum(per_slot)
            if n == 0:
                continue
            xs = grouped[start:start + n]
            runs = [(s - 1, lo, c) for s, (lo, c) in enumerate(_runs(per_slot)) if s and c]
            gate_up = base.expert_linear(xs, expert, down=False)
            for slot, lo, c in runs:
                gate_up[lo:lo + c] += (xs[lo:lo + c] @ self.a13[slot, expert].t()) \
                    @ self.b13[slot, expert].t()
            h = base.act_fn(gate_up)
            y = base.expert_linear(h, expert, down=True)
            for slot, lo, c in runs:
                y[lo:lo + c] += (h[lo:lo + c] @ self.a2[slot, expert].t()) \
                    @ self.b2[slot, expert].t()
            out[start:start + n] = y
            start += n
        return out, order


def _runs(counts: list[int]) -> list[tuple[int, int]]:
    """(offset, count) of each group within an expert's rows."""
    out, lo = [], 0
    for c in counts:
        out.append((lo, c))
        lo += c
    return out
