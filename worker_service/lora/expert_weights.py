"""An adapter's LoRA on routed MoE experts, as the stacks one experts module needs
(docs/lora.md, "MoE experts").

Two forms, as peft writes them:
  - per expert (peft over transformers 4, and vLLM's form): modules `...mlp.experts.<e>.
    gate_proj / up_proj / down_proj` (Mixtral: `...block_sparse_moe.experts.<e>.w1 / w3 / w2`),
    each A [r, in], B [out, r]; the model's checkpoint_target maps them as their base weights;
  - fused (peft's target_parameters over transformers 5): one module per parameter,
    `...mlp.experts` and, when both parameters are adapted, the inner `...experts.base_layer`;
    A [E * r', in] (expert-major rows), B [out, r' * E] (expert-minor columns: peft's
    ParamWrapper reshapes B to [out, r', E]). Which parameter a module is, is read from its
    shapes: gate_up_proj's A has H columns and B 2I rows, down_proj's A I columns and B H rows;
    both cannot hold at once.

Stacks per slot and expert, the scaling folded into B, this rank's slice under tensor
parallelism (as the base weights: gate/up rows, down columns): a13 [S, E, R13, H],
b13 [S, E, 2 I_r, R13] (gate's rank block first, then up's; a fused gate_up one block over
both), a2 [S, E, R2, I_r], b2 [S, E, H, R2], and has [S, E]: which experts a slot adapts.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from worker_service.lora.adapter import LoRAAdapter, LoRAError
from worker_service.lora.stack_shapes import expert_shapes

_EXPERT_MODULE = re.compile(r"\.experts(\.|$)")
_PIECE = {"gate_proj": 0, "up_proj": 1}


def is_expert_module(ckpt: str) -> bool:
    """Whether checkpoint module `ckpt` belongs to routed experts (either form)."""
    return _EXPERT_MODULE.search(ckpt) is not None


def expert_pieces(model: nn.Module, ad: LoRAAdapter, ckpt: str, a: torch.Tensor,
                  b: torch.Tensor, experts_of) -> tuple[str, list[tuple]]:
    """(our experts module path, [(expert, "w13" | "w2", piece, A, B, scaling)]) of one
    checkpoint module; piece 0 gate, 1 up, None the whole parameter. `experts_of(path)`: the
    MoEExperts there, or None. LoRAError naming the adapter and module otherwise."""
    what = f"LoRA adapter {ad.name!r}: module {ckpt}"
    if ckpt.endswith((".experts", ".experts.base_layer")) and ad.params:
        path = ckpt.removesuffix(".base_layer")
        return path, _fused(_experts(model, experts_of, path, what), ad, a, b, what)
    target = getattr(model, "checkpoint_target", lambda _: None)(f"{ckpt}.weight")
    if not target or not target[1] or target[0].rsplit(".", 1)[-1] not in ("w13_weight",
                                                                         "w2_weight"):
        raise LoRAError(f"{what} is not a routed expert's projection of this "
                        f"{type(model).__name__} model (served: experts.<e>.gate_proj / "
                        f"up_proj / down_proj, Mixtral's w1 / w3 / w2, or peft's "
                        f"target_parameters gate_up_proj / down_proj)")
    path = target[0].rsplit(".", 1)[0]
    experts = _experts(model, experts_of, path, what)
    expert, proj = target[1]
    if not 0 <= expert < experts.num_experts:
        raise LoRAError(f"{what}: expert {expert} is out of range: the model has "
                        f"num_experts={experts.num_experts}")
    h, i = _sizes(experts)
    down = proj == "down_proj"
    want_in, want_out = (i, h) if down else (h, i)
    if a.shape[1] != want_in or b.shape[0] != want_out:
        raise LoRAError(f"{what}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                        f"the base expert ([out={want_out}, in={want_in}])")
    kind = "w2" if down else "w13"
    return path, [(expert, kind, None if down else _PIECE[proj], a, b, ad.scaling)]


def _experts(model, experts_of, path: str, what: str):
    experts = experts_of(path)
    if experts is None:
        raise LoRAError(f"{what} is not a routed expert's projection of this "
                        f"{type(model).__name__} model")
    return experts


def _sizes(experts) -> tuple[int, int]:
    """(H, I): the hidden size and the whole (unsharded) expert width."""
    return experts.w13_weight.shape[2], experts.inter_per_rank * experts.tp.world_size


def _fused(experts, ad: LoRAAdapter, a: torch.Tensor, b: torch.Tensor, what: str) -> list:
    h, i = _sizes(experts)
    num = experts.num_experts
    if a.shape[1] == h and b.shape[0] == 2 * i:
        param, kind = "gate_up_proj", "w13"
    elif a.shape[1] == i and b.shape[0] == h:
        param, kind = "down_proj", "w2"
    else:
        raise LoRAError(f"{what}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} fit "
                        f"neither fused expert parameter (gate_up_proj: [{2 * i}, {h}], "
                        f"down_proj: [{h}, {i}], {num} experts)")
    if param not in ad.params:
        raise LoRAError(f"{what}: its shapes are {param}'s, which target_parameters "
                        f"{sorted(ad.params)} does not list")
    rank, scaling = ad.params[param]
    if a.shape[0] != num * rank or b.shape[1] != num * rank:
        raise LoRAError(f"{what}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not "
                        f"{num} experts (the model's num_experts) of rank {rank} ({param}'s r in "
                       f"adapter_config.json): an adapter of another model?")
    a_e = a.reshape(num, rank, a.shape[1])
    b_e = b.reshape(b.shape[0], rank, num).permute(2, 0, 1)
    return [(e, kind, None, a_e[e], b_e[e], scaling) for e in range(num)]


def expert_stacks(experts, by_slot: dict[int, list], num_slots: int, dtype, device
                  ) -> tuple[torch.Tensor, ...]:
    """(a13, b13, a2, b2, has) for one experts module; by_slot: slot -> expert_pieces'
    entries. LoRAError when one adapter gives an expert's parameter twice (both forms)."""
    h, i_r, num = experts.w13_weight.shape[2], experts.inter_per_rank, experts.num_experts
    start = experts.tp.rank * i_r
    r13 = max([_width(p) for ps in by_slot.values() for p in ps if p[1] == "w13"], default=1)
    r2 = max([p[3].shape[0] for ps in by_slot.values() for p in ps if p[1] == "w2"],
             default=1)
    *stacks, has_shape = expert_shapes(num_slots, num, h, i_r, r13, r2)
    a13, b13, a2, b2 = (torch.zeros(shape) for shape in stacks)
    has = torch.zeros(has_shape, dtype=torch.bool)
    for slot, pieces in by_slot.items():
        seen: dict[tuple[int, str], set] = {}
        for e, kind, piece, a, b, scaling in pieces:
            got = seen.setdefault((e, kind), set())
            if piece in got or None in got or (piece is None and got):
                raise LoRAError(f"expert {e}'s {kind} is adapted twice in one adapter "
                                f"(per-expert modules and target_parameters)")
            got.add(piece)
            has[slot, e] = True
            r = a.shape[0]
            if kind == "w2":
                a2[slot, e, :r] = a[:, start:start + i_r]
                b2[slot, e, :, :r] = b * scaling
            elif piece is None:   # fused: rows [gate I; up I], this rank's slice of each
                half = b.shape[0] // 2
                a13[slot, e, :r] = a
                b13[slot, e, :, :r] = torch.cat([b[start:start + i_r],
                                                 b[half + start:half + start + i_r]]) * scaling
            else:                 # gate's rows and rank block first, then up's
                a13[slot, e, piece * r:(piece + 1) * r] = a
                b13[slot, e, piece * i_r:(piece + 1) * i_r,
                    piece * r:(piece + 1) * r] = b[start:start + i_r] * scaling
    cast = dict(device=device, dtype=dtype)
    return a13.to(**cast), b13.to(**cast), a2.to(**cast), b2.to(**cast), has.to(device)


def _width(piece: tuple) -> int:
    """The rank columns a w13 piece needs: a fused gate_up its rank, gate / up two blocks."""
    return piece[3].shape[0] * (1 if piece[2] is None else 2)
