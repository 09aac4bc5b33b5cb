"""LoRAExperts (worker_service/lora/experts.py) against a torch reference that merges each
adapter into dense copies of the expert weights (W + scale * B @ A) and runs every token
through its own top-k experts: a step mixing two adapters and base tokens, one adapter on
every expert (fused gate_up) and one on a few experts and pieces only, so tokens reach
experts their adapter leaves alone. On the plain parameters and on the packed CPU panels
(weights released: NaN stand-ins), where only the panels can be read."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from worker_service.layers.moe import MoEExperts
from worker_service.lora.expert_weights import expert_stacks
from worker_service.lora.experts import LoRAExperts
from worker_service.lora.layers import LoRAState
from worker_service.parallel_state import single_rank_group

E, H, INTER, K, T = 6, 32, 16, 2, 23


def _experts(packed: bool, dtype=torch.float32, fused_moe: bool | None = None
             ) -> tuple[MoEExperts, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    experts = MoEExperts(E, H, INTER, single_rank_group(), dtype, fused_moe=fused_moe)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=gen), torch.randn(E, H, INTER,
                                                                         generator=gen)
    experts.w13_weight.data.copy_(w13 * 0.2)
    experts.w2_weight.data.copy_(w2 * 0.2)
    w13, w2 = experts.w13_weight.detach().float(), experts.w2_weight.detach().float()
    if packed:
        if not experts.use_cpu_kernels():
            pytest.skip("the CPU kernels are not available")
        assert experts.release_expert_weights()
        assert experts.w13_weight.isnan().all()
    return experts, w13, w2


def _pieces(gen) -> dict[int, list]:
    """slot 0: every expert, fused gate_up (rank 6) and down (rank 3); slot 1: expert 2's gate,
    expert 4's up and down (rank 2)."""
    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.3
    fused = [(e, "w13", None, r(6, H), r(2 * INTER, 6), 0.5) for e in range(E)]
    fused += [(e, "w2", None, r(3, INTER), r(H, 3), 0.5) for e in range(E)]
    few = [(2, "w13", 0, r(2, H), r(INTER, 2), 2.0), (4, "w13", 1, r(2, H), r(INTER, 2), 2.0),
           (4, "w2", None, r(2, INTER), r(H, 2), 2.0)]
    return {0: fused, 1: few}


def _merged(w13, w2, pieces) -> tuple[torch.Tensor, torch.Tensor]:
    w13, w2 = w13.clone(), w2.clone()
    for e, kind, piece, a, b, scale in pieces:
        delta = scale * b @ a
        if kind == "w2":
            w2[e] += delta
        elif piece is None:
            w13[e] += delta
        else:
            w13[e, piece * INTER:(piece + 1) * INTER] += delta
    return w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True], ids=["params", "packed"])
def test_mixed_step_matches_merged_weights(packed, dtype):
    """bf16: the routes are given, so no flip: within bf16's rounding of x, weights, stacks."""
    experts, w13, w2 = _experts(packed, dtype)
    gen = torch.Generator().manual_seed(1)
    by_slot = _pieces(gen)
    state = LoRAState(torch.device("cpu"), 2)
    lora = LoRAExperts(experts, state, *expert_stacks(experts, by_slot, 2, dtype, "cpu"))
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=gen), -1).to(dtype)
    slots = np.array([0, 1, -1] * (T // 3) + [1] * (T % 3))
    state.set_token_slots(slots)
    merged = {-1: (w13, w2), **{s: _merged(w13, w2, p) for s, p in by_slot.items()}}
    with torch.no_grad():
        got = lora(x, weights, ids).float()
    want = _reference(merged, slots, x.float(), weights.float(), ids)
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    torch.testing.assert_close(got, want, atol=tol, rtol=1e-4 if dtype == torch.float32 else 2e-2)
    # slot 1's tokens reach experts it leaves alone: the check covers both kinds of pair
    touched = {2, 4}
    reached = {int(e) for t in np.flatnonzero(slots == 1) for e in ids[t]}
    assert reached & touched and reached - touched
    # a step of base tokens only (the base module: the packed kernel when packed)
    base = np.full(T, -1)
    state.set_token_slots(base)
    with torch.no_grad():
        torch.testing.assert_close(lora(x, weights, ids).float(),
                                   _reference(merged, base, x.float(), weights.float(), ids),
                                   atol=tol, rtol=1e-4 if dtype == torch.float32 else 2e-2)


class _Counted:
    """A CpuExperts that counts its kernel calls (everything else passes through)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_packed_kernel_runs_unless_most_pairs_are_adapted():
    """Kernel calls per step: base rows only, adapter rows whose routes miss the adapted
    experts, and a few adapter rows: one (the adapted pairs beside it on the grouped path);
    every row on an adapter that adapts every expert: none (all grouped). Each == merged."""
    experts, w13, w2 = _experts(packed=True)
    gen = torch.Generator().manual_seed(2)
    by_slot = _pieces(gen)
    state = LoRAState(torch.device("cpu"), 2)
    lora = LoRAExperts(experts, state, *expert_stacks(experts, by_slot, 2, torch.float32, "cpu"))
    counted = experts.cpu_experts = _Counted(experts.cpu_experts)
    merged = {-1: (w13, w2), **{s: _merged(w13, w2, p) for s, p in by_slot.items()}}
    x = torch.randn(T, H, generator=gen)
    weights = torch.softmax(torch.randn(T, K, generator=gen), -1)
    untouched = torch.tensor([0, 1, 3, 5])                # slot 1 adapts experts 2 and 4
    miss = torch.stack([untouched[torch.randperm(4, generator=gen)[:K]] for _ in range(T)])
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    few = np.full(T, -1)
    few[[3, 9]] = 0
    steps = {"base": (np.full(T, -1), ids, 1), "misses": (np.ones(T, dtype=np.int64), miss, 1),
             "few": (few, ids, 1), "all adapted": (np.zeros(T, dtype=np.int64), ids, 0)}
    for name, (slots, routes, calls) in steps.items():
        counted.calls = 0
        state.set_token_slots(slots)
        with torch.no_grad():
            got = lora(x, weights, routes)
        assert counted.calls == calls, name
        torch.testing.assert_close(got, _reference(merged, slots, x, weights, routes),
                                   atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _reference(merged, slots, x, weights, ids) -> torch.Tensor:
    """Each token through its top-k experts with its adapter's merged weights."""
    out = torch.zeros(T, H)
    for t in range(T):
        m13, m2 = merged[int(slots[t])]
        for k in range(K):
            e = int(ids[t, k])
            gate, up = F.linear(x[t], m13[e]).chunk(2)
            out[t] += weights[t, k] * F.linear(F.silu(gate) * up, m2[e])
    return out


def test_unloading_the_last_expert_adapter_unwraps_the_experts(tiny_models, tmp_path):
    """LoRASlots at run time: an expert adapter wraps each adapted experts module, a second
    load keeps the wrapper with new stacks, and unloading the last adapter on experts gives
    the MoEExperts back (the base path, packed kernel included)."""
    from tests.support.lora_adapters import make_adapter
    from tests.support.moe_lora import per_expert_adapter
    from tests.support.paged_prefill import load
    from worker_service.lora.slots import LoRASlots

    path = tiny_models("qwen3_moe")
    model = load(path)
    slots = LoRASlots(model, 16)
    slots.load(1, "experts", per_expert_adapter(path, tmp_path / "e", experts={0: [1]}))
    layers = model.model.layers
    assert isinstance(layers[0].mlp.experts, LoRAExperts)
    assert isinstance(layers[2].mlp.experts, MoEExperts)          # no expert of it adapted
    slots.load(2, "attn", make_adapter(path, tmp_path / "a", r=4, targets=("q_proj",)))
    assert layers[0].mlp.experts.has.tolist()[0][1] and not any(
        layers[0].mlp.experts.has.tolist()[1])
    packed = layers[0].mlp.experts.base
    assert slots.unload(1)
    assert layers[0].mlp.experts is packed               # the same packed module, unwrapped
    assert packed.weights_released == (packed.cpu_experts is not None)
    assert type(layers[0].self_attn.qkv_proj).__name__ == "LoRALinear"


def test_few_adapter_rows_beside_the_fused_triton_experts():
    """The fused Triton path (CUDA's; here under Triton's interpreter) takes the pairs no
    adapter touches, with the adapted pairs' weights zeroed; those run grouped: == merged."""
    pytest.importorskip("triton")
    experts, w13, w2 = _experts(packed=False, fused_moe=True)
    gen = torch.Generator().manual_seed(3)
    by_slot = _pieces(gen)
    state = LoRAState(torch.device("cpu"), 2)
    lora = LoRAExperts(experts, state, *expert_stacks(experts, by_slot, 2, torch.float32, "cpu"))
    merged = {-1: (w13, w2), **{s: _merged(w13, w2, p) for s, p in by_slot.items()}}
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=gen), -1)
    slots = np.full(T, -1)
    slots[[1, 5]], slots[[7, 8]] = 0, 1
    state.set_token_slots(slots)
    with torch.no_grad():
        got = lora(x, weights, ids)
    torch.testing.assert_close(got, _reference(merged, slots, x, weights, ids), atol=1e-4,
                               rtol=1e-4)
