"""The LoRA-aware projections: y = base(x) + scale_i * (x A_i^T) B_i^T for the token rows of
adapter i (docs/lora.md).

attach_lora swaps each targeted projection (qkv_proj, o_proj, gate_up_proj, down_proj, c_fc,
...: families.py lists each model's) for a LoRALinear that holds every adapter's A and B stacked by slot (adapter id - 1), the scaling folded
into B. Packed projections keep one rank-R block per piece (q, k, v; gate, up): A pieces stacked
along the rank, B block-diagonal. Tensor parallel, as the base layer: column-parallel B is split by
output rows (the base layer's own weight loader picks this rank's rows), row-parallel A by input
columns, and its partial delta joins the base partial sums before the one all-reduce.

The adapter rows of a step come from LoRAState.set_token_slots; the forward is a loop over the
adapters present (at most --max-loras), each an index_select, two GEMMs and an index_add
(one adapter on every row: no gather at all). Without LoRA the model is not touched.
Routed MoE experts an adapter targets become a LoRAExperts (experts.py, expert_weights.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from worker_service.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                          QKVParallelLinear, RowParallelLinear)
from worker_service.layers.moe import MoEExperts
from worker_service.lora.adapter import MAX_HEADER_BYTES, LoRAAdapter, LoRAError
from worker_service.lora.expert_weights import expert_pieces, expert_stacks, is_expert_module
from worker_service.lora.experts import LoRAExperts
from worker_service.lora.families import lora_targets
from worker_service.lora.stack_shapes import dense_shapes

class LoRAState:
    """Which adapter each token row of the current forward uses, shared by every LoRALinear."""

    def __init__(self, device: torch.device, num_adapters: int) -> None:
        self.device = device
        self.num_adapters = num_adapters
        # (slot, rows): rows None = every row; empty: the base model alone
        self.segments: list[tuple[int, torch.Tensor | None]] = []
        self._slots: np.ndarray | None = None
        self._slots_tensor: torch.Tensor | None = None

    def slots_tensor(self) -> torch.Tensor | None:
        """The step's slot per token row on the device (made at the first ask of a step: only
        adapted MoE experts need it), or None without adapter rows."""
        if self._slots_tensor is None and self.segments and self._slots is not None:
            self._slots_tensor = torch.from_numpy(self._slots).to(self.device)
        return self._slots_tensor if self.segments else None

    def set_token_slots(self, slots: np.ndarray) -> None:
        """slots: int [num_tokens], an adapter's slot (id - 1) per token row, -1 for none."""
        self._slots, self._slots_tensor = np.asarray(slots, dtype=np.int64), None
        present = np.unique(slots)
        present = present[present >= 0]
        if len(present) == 1 and slots[0] == present[0] and (slots == present[0]).all():
            self.segments = [(int(present[0]), None)]
            return
        self.segments = [(int(s), torch.from_numpy(np.flatnonzero(slots == s)).to(self.device))
                         for s in present]

    def set_rows(self, row_slots: np.ndarray, num_scheduled: np.ndarray) -> None:
        """A step's slots by batch row and its token counts per row, in query order."""
        self.set_token_slots(np.repeat(row_slots, num_scheduled))

    def clear(self) -> None:
        self.segments, self._slots, self._slots_tensor = [], None, None


class LoRALinear(nn.Module):
    """A base projection plus the stacked adapters: a [S, R', in] and b [S, out, R']."""

    def __init__(self, base: nn.Module, state: LoRAState, a: torch.Tensor,
                 b: torch.Tensor) -> None:
        super().__init__()
        self.base, self.state = base, state
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", b, persistent=False)

    def _add_delta(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        for slot, rows in self.state.segments:
            a, b = self.lora_a[slot], self.lora_b[slot]
            if rows is None:
                y = y + (x @ a.t()) @ b.t()
            else:
                y = y.index_add(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if not self.row_parallel or base.tp.world_size == 1:
            return self._add_delta(base(x), x)
        y = base.tp.all_reduce(self.matmul(x))
        return y if base.bias is None else y + base.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T plus the adapters' delta, no bias and no all-reduce: a row-parallel layer's
        partial sum (a shared expert's down_proj, reduced by its MoE block)."""
        return self._add_delta(self.base.matmul(x), x)


def _pieces(module: nn.Module) -> tuple:
    if isinstance(module, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(module, MergedColumnParallelLinear):
        return tuple(range(len(module.output_sizes)))
    return (None,)


def _local_pair(module: nn.Module, piece, a: torch.Tensor, b: torch.Tensor, what: str):
    """This rank's (A [r, in_rank], B [out_rank, r]) of one piece; B holds zeros outside the
    piece's rows. LoRAError when the shapes do not fit the base layer."""
    r = a.shape[0]
    if isinstance(module, RowParallelLinear):
        in_total = module.input_size_per_rank * module.tp.world_size
        if a.shape[1] != in_total or b.shape[0] != module.weight.shape[0]:
            raise LoRAError(f"{what}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                            f"fit the base layer ([out={module.weight.shape[0]}, in={in_total}])")
        a_local = a.new_zeros(r, module.input_size_per_rank)
        module.weight_loader(SimpleNamespace(data=a_local), a)
        return a_local, b
    if a.shape[1] != module.input_size:
        raise LoRAError(f"{what}: lora_A {tuple(a.shape)} does not fit the base layer's "
                        f"input size {module.input_size}")
    b_local = b.new_zeros(module.output_size_per_rank, r)
    try:
        module.weight_loader(SimpleNamespace(data=b_local), b, piece)
    except ValueError as e:
        raise LoRAError(f"{what}: lora_B {tuple(b.shape)} does not fit the base layer "
                        f"({e})") from None
    return a, b_local


def _stacks(path: str, module: nn.Module, by_piece: dict, adapters: dict[int, LoRAAdapter],
            num_slots: int, rank: int, dtype: torch.dtype, device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """a [S, P*rank, in_rank], b [S, out_rank, P*rank] for one of our modules; by_piece maps
    (slot, piece) -> (checkpoint module name, A, B). Slots no adapter holds stay zero."""
    pieces = _pieces(module)
    in_rank = (module.input_size_per_rank if isinstance(module, RowParallelLinear)
               else module.input_size)
    out_rank = module.weight.shape[0]
    a_shape, b_shape = dense_shapes(num_slots, len(pieces), rank, in_rank, out_rank)
    a_all, b_all = torch.zeros(a_shape), torch.zeros(b_shape)
    for (i, piece), (ckpt, a, b) in by_piece.items():
        ad = adapters[i]
        a, b = _local_pair(module, piece, a, b, f"LoRA adapter {ad.name!r}: {ckpt}")
        p, r = pieces.index(piece), a.shape[0]
        a_all[i, p * rank:p * rank + r] = a
        b_all[i, :, p * rank:p * rank + r] = b * ad.scaling
    return a_all.to(device=device, dtype=dtype), b_all.to(device=device, dtype=dtype)


def max_adapter_bytes(model: nn.Module, max_rank: int) -> int:
    """The most bytes an adapter_model.safetensors that fits `model` can hold: rank max_rank
    on every projection, each piece's A [r, in] and B [out, r] at full (unsharded) size, as
    float64, plus the largest header we read. A bigger file cannot fit and is refused unread
    (read_adapter), never loaded whole into the worker's memory."""
    total = 0
    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            fan_in, fan_out, pieces = (module.input_size_per_rank * module.tp.world_size,
                                       module.weight.shape[0], 1)
        elif isinstance(module, ColumnParallelLinear):
            fan_in, fan_out = module.input_size, module.output_size_per_rank * module.tp.world_size
            pieces = len(_pieces(module))
        elif isinstance(module, MoEExperts):    # a fused gate_up of rank 2r and down, per expert
            hidden = module.w13_weight.shape[2]
            inter = module.inter_per_rank * module.tp.world_size
            total += module.num_experts * max_rank * (3 * hidden + 5 * inter) * 8
            continue
        else:
            continue
        total += max_rank * (pieces * fan_in + fan_out) * 8
    return total + 8 + MAX_HEADER_BYTES


def _base(module: nn.Module | None) -> nn.Module | None:
    """The projection (or experts) itself, whether or not a LoRA wrapper wraps it already."""
    return module.base if isinstance(module, (LoRALinear, LoRAExperts)) else module


def _checkpoint_pieces(model: nn.Module, ad: LoRAAdapter, ckpt: str, a: torch.Tensor,
                       b: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(module, A, B) pieces of one adapted checkpoint module: lora_B goes through the model's
    split_checkpoint_tensor as its base weight did (a fused qkv_proj / gate_up_proj cut by
    rows, GLM's and Cohere's q/k rows reordered); every piece keeps the whole A."""
    split = getattr(model, "split_checkpoint_tensor", None)
    try:
        parts = split(f"{ckpt}.weight", b) if split is not None else None
    except (ValueError, RuntimeError) as e:        # rows that do not fit the base model
        raise LoRAError(f"LoRA adapter {ad.name!r}: {ckpt}: lora_B {tuple(b.shape)} does not "
                        f"fit the base layer ({e})") from None
    if parts is None:
        return [(ckpt, a, b)]
    return [(name[:-len(".weight")], a, piece) for name, piece in parts]


def _targets(model: nn.Module, adapters: dict[int, LoRAAdapter]
             ) -> tuple[dict[str, dict], dict[str, dict]]:
    """(our projection path -> {(slot, piece): (checkpoint module, A, B)}, our experts path ->
    {slot: expert_pieces' entries}); LoRAError naming the adapter and module for a module
    that is not one of our projections or experts."""
    modules = dict(model.named_modules())
    targets: dict[str, dict] = {}
    experts: dict[str, dict] = {}

    def experts_of(path: str):
        found = _base(modules.get(path))
        return found if isinstance(found, MoEExperts) else None

    for i, ad in adapters.items():
        for ckpt, (a, b) in ad.weights.items():
            if is_expert_module(ckpt):
                path, pieces = expert_pieces(model, ad, ckpt, a, b, experts_of)
                experts.setdefault(path, {}).setdefault(i, []).extend(pieces)
                continue
            for name, a_part, b_part in _checkpoint_pieces(model, ad, ckpt, a, b):
                prefix, _, leaf = name.rpartition(".")
                ours, piece = model.packed_modules.get(leaf, (leaf, None))
                path = f"{prefix}.{ours}"
                if not isinstance(_base(modules.get(path)),
                                  (ColumnParallelLinear, RowParallelLinear)):
                    raise LoRAError(f"LoRA adapter {ad.name!r}: module {ckpt} is not a "
                                    f"projection of this {type(model).__name__} model")
                targets.setdefault(path, {})[(i, piece)] = (ckpt, a_part, b_part)
    return targets, experts


def plan_lora(model: nn.Module, adapters: dict[int, LoRAAdapter]) -> dict[str, tuple]:
    """Module path -> (base projection, a, b): the stacks every targeted projection of `model`
    needs for `adapters` (slot -> adapter). Changes nothing: LoRAError naming the adapter and
    module for a model or module we cannot adapt, or shapes that do not fit."""
    lora_targets(model)                  # LoRAError naming the model class and the served ones
    if not adapters:
        return {}
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    num_slots, rank = max(adapters) + 1, max(ad.rank for ad in adapters.values())
    plan = {}
    targets, experts = _targets(model, adapters)
    for path, by_piece in targets.items():
        base = _base(modules[path])
        plan[path] = (base, *_stacks(path, base, by_piece, adapters, num_slots, rank,
                                     model.dtype, device))
    for path, by_slot in experts.items():
        base = _base(modules[path])
        try:
            stacks = expert_stacks(base, by_slot, num_slots, model.dtype, device)
        except LoRAError as e:
            names = sorted({adapters[i].name for i in by_slot})
            raise LoRAError(f"LoRA adapter(s) {names}: {path}: {e}") from None
        plan[path] = (base, *stacks)
    return plan


def apply_lora(model: nn.Module, state: LoRAState, plan: dict[str, tuple],
               num_slots: int) -> None:
    """Make `model` what `plan` says: planned projections wrapped (or their stacks replaced:
    new tensors, so a step still on the device reads the old ones), the others unwrapped."""
    modules = dict(model.named_modules())
    for path, module in modules.items():
        if isinstance(module, (LoRALinear, LoRAExperts)) and path not in plan:
            parent, _, leaf = path.rpartition(".")
            setattr(modules[parent], leaf, module.base)
    for path, (base, *stacks) in plan.items():
        current = modules[path]
        if isinstance(current, LoRAExperts):
            current.set_stacks(*stacks)
        elif isinstance(current, LoRALinear):
            current.lora_a, current.lora_b = stacks
        else:
            parent, _, leaf = path.rpartition(".")
            wrap = LoRAExperts if isinstance(base, MoEExperts) else LoRALinear
            setattr(modules[parent], leaf, wrap(base, state, *stacks))
    state.num_adapters = num_slots


def attach_lora(model: nn.Module, adapters: list[LoRAAdapter]) -> LoRAState:
    """Wrap the projections of `model` that any adapter targets (adapter i in slot i);
    LoRAError naming the adapter and module for a model or module we cannot adapt."""
    state = LoRAState(next(model.parameters()).device, len(adapters))
    apply_lora(model, state, plan_lora(model, dict(enumerate(adapters))), len(adapters))
    return state
