"""The routed experts on the CPU's packed kernels (kernels/cpu/moe_experts.py, one C++ call per
layer over every expert's panel-packed weights): after use_cpu_kernels() a CPU block takes them
for a decode-sized batch, and they equal both the grouped F.linear path and transformers'
Qwen3MoeSparseMoeBlock on the same weights, at routings that leave experts without tokens, send
every token to every expert (top-k = E), or put a whole batch on one expert; bfloat16 rounds
where the grouped path does, so the two agree to the bit there."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension, moe_experts
from kernels.cpu.moe_experts import MAX_MEAN_ROWS
from tests.unit.worker_service.models.test_moe import H, E, hf_block, our_block
from worker_service.layers.cpu_kernels import use_cpu_kernels
from worker_service.layers.moe import MoEExperts
from worker_service.parallel_state import TPGroup, single_rank_group

pytestmark = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


def packed_and_grouped(experts: MoEExperts, x, weights, ids):
    """(the packed kernel's output, the grouped F.linear path's) for one call each; the
    grouped path forced by a row limit of 0 (after use_cpu_kernels it reads the panels: the
    parameters are gone)."""
    packed_experts = experts.cpu_experts
    calls = packed_experts.calls
    with torch.no_grad():
        packed = experts(x, weights, ids)
        assert packed_experts.calls == calls + 1          # the packed path was taken
        kept, packed_experts.max_mean_rows = packed_experts.max_mean_rows, 0
        try:
            grouped = experts(x, weights, ids)
        finally:
            packed_experts.max_mean_rows = kept
    assert packed_experts.calls == calls + 1              # the grouped one was not
    return packed, grouped


def routings(num_tokens: int, top_k: int, seed: int):
    """ids [T, k]: random distinct experts per token, expert E - 1 never used (unless k = E,
    every expert for every token, in a different order per token), and weights that sum to 1."""
    g = torch.Generator().manual_seed(seed)
    pool = E if top_k == E else E - 1
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g).softmax(-1)
    return weights, ids


@pytest.mark.parametrize("top_k", [1, 2, E])
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
def test_packed_block_equals_transformers_and_the_grouped_path(num_tokens, top_k):
    cfg, theirs = hf_block("qwen3_moe", norm_topk_prob=True)
    theirs.top_k = theirs.gate.top_k = top_k
    cfg.num_experts_per_tok = top_k
    ours = our_block(cfg, theirs, single_rank_group())
    assert use_cpu_kernels(ours) >= 1 and ours.experts.cpu_experts is not None
    x = torch.randn(num_tokens, H)
    with torch.no_grad():
        expected = theirs(x[None])[0]
        weights, ids = ours.gate(x)
    if top_k < E and num_tokens < E:
        assert ids.unique().numel() < E                 # some expert gets no token
    packed, grouped = packed_and_grouped(ours.experts, x, weights, ids)
    torch.testing.assert_close(packed, grouped, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0)])
@pytest.mark.parametrize("num_tokens, top_k", [(1, 3), (9, 3), (4, E)])
def test_packed_experts_equal_the_grouped_path(dtype, atol, num_tokens, top_k):
    experts = MoEExperts(E, H, 24, single_rank_group(), dtype)
    with torch.no_grad():
        experts.w13_weight.normal_(0.0, 0.3)
        experts.w2_weight.normal_(0.0, 0.3)
    assert use_cpu_kernels(experts) == 2                # the experts and their SiluAndMul
    x = torch.randn(num_tokens, H).to(dtype)
    weights, ids = routings(num_tokens, top_k, seed=num_tokens)
    if top_k < E:
        assert (ids != E - 1).all()                     # the last expert has zero tokens
    packed, grouped = packed_and_grouped(experts, x, weights.to(dtype), ids)
    assert packed.dtype == dtype
    torch.testing.assert_close(packed, grouped, rtol=0, atol=atol)


def test_one_expert_taking_every_token_and_the_row_limit():
    """All rows on expert 3 (one group, the others skipped); past MAX_MEAN_ROWS rows an expert on
    average the block keeps the grouped path (a long prefill)."""
    experts = MoEExperts(E, H, 24, single_rank_group(), torch.float32)
    with torch.no_grad():
        experts.w13_weight.normal_(0.0, 0.3)
        experts.w2_weight.normal_(0.0, 0.3)
    use_cpu_kernels(experts)
    x = torch.randn(7, H)
    ids = torch.full((7, 2), 3)
    ids[:, 1] = 5
    packed, grouped = packed_and_grouped(experts, x, torch.full((7, 2), 0.5), ids)
    torch.testing.assert_close(packed, grouped, rtol=0, atol=1e-5)
    limit = MAX_MEAN_ROWS[torch.float32] * E
    for pairs, packed in ((limit, 1), (limit + 2, 0)):
        calls, tokens = experts.cpu_experts.calls, pairs // 2
        with torch.no_grad():
            experts(torch.randn(tokens, H), torch.full((tokens, 2), 0.5),
                    torch.arange(tokens * 2).view(tokens, 2) % E)
        assert experts.cpu_experts.calls == calls + packed, pairs


def test_tp_slices_on_the_packed_path_sum_to_the_whole_block():
    """Each rank packs its half of every expert (and lets its parameters go): the partial sums
    still add up to the block, on the packed kernel and on the grouped path reading the
    rank's panels back."""
    cfg, theirs = hf_block("qwen2_moe", norm_topk_prob=False)
    x = torch.randn(6, H)
    with torch.no_grad():
        expected = theirs(x[None])[0]
    totals = [torch.zeros_like(x), torch.zeros_like(x)]
    for rank in range(2):
        part = our_block(cfg, theirs, TPGroup(rank=rank, world_size=2))
        use_cpu_kernels(part)
        assert part.experts.weights_released
        with torch.no_grad():
            weights, ids = part.gate(x)
            shared = part.shared_expert_gate(x) * part.shared_expert(x)
        for total, partial in zip(totals, packed_and_grouped(part.experts, x, weights, ids)):
            total += partial + shared
    for total in totals:
        torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)


def test_forced_fused_experts_are_not_packed():
    experts = MoEExperts(E, H, 24, single_rank_group(), torch.float32, fused_moe=True)
    assert not experts.use_cpu_kernels() and experts.cpu_experts is None


def random_experts(dtype: torch.dtype, fused_moe: bool | None = None) -> MoEExperts:
    experts = MoEExperts(E, H, 24, single_rank_group(), dtype, fused_moe=fused_moe)
    with torch.no_grad():
        experts.w13_weight.normal_(0.0, 0.3)
        experts.w2_weight.normal_(0.0, 0.3)
    return experts


def grouped_reference(experts: MoEExperts) -> MoEExperts:
    """An unpacked copy of `experts` (its own dense parameters, the same SiluAndMul kernel):
    the grouped path before any release."""
    ref = MoEExperts(E, H, 24, single_rank_group(), experts.w13_weight.dtype)
    with torch.no_grad():
        ref.w13_weight.copy_(experts.w13_weight)
        ref.w2_weight.copy_(experts.w2_weight)
    ref.act_fn.use_cpu_kernels()
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_let_their_weights_go_and_long_prefills_read_the_panels(dtype):
    """After the model's use_cpu_kernels the stacked parameters are one-element NaNs seen as
    their shapes; a prefill past the row limit (the grouped path) runs each expert's GEMMs on
    the panels and equals the grouped path on the dense weights up to the order of the sums
    (float32 ~1e-6, bfloat16 within one rounding); a second
    use_cpu_kernels keeps the panels (never re-packs the NaNs); a weight loader writing into a
    released parameter fails loudly."""
    experts = random_experts(dtype)
    ref = grouped_reference(experts)
    shapes = (experts.w13_weight.shape, experts.w2_weight.shape)
    assert use_cpu_kernels(experts) == 2 and experts.weights_released
    for p, shape in zip((experts.w13_weight, experts.w2_weight), shapes):
        assert p.shape == shape and p.untyped_storage().nbytes() == p.element_size()
        assert p.isnan().all()
    tokens = MAX_MEAN_ROWS[dtype] * E // 2 + 1          # top-2: just past the limit
    weights, ids = routings(tokens, 2, seed=3)
    x = torch.randn(tokens, H).to(dtype)
    packed = experts.cpu_experts
    with torch.no_grad():
        got = experts(x, weights.to(dtype), ids)
        want = ref(x, weights.to(dtype), ids)
    assert packed.calls == 0 and not got.isnan().any()
    # no dense copy of an expert: float32, and bfloat16 with AVX512-BF16, read the panels
    in_place = dtype == torch.float32 or extension.ops().panel_bf16_dot()
    assert packed.reads_panels_in_place is in_place
    torch.testing.assert_close(got, want)
    assert experts.use_cpu_kernels() and experts.cpu_experts is packed
    with pytest.raises(RuntimeError):
        experts.weight_loader(experts.w2_weight, torch.zeros(H, 24), (0, "down_proj"))


@pytest.mark.parametrize("dtype, fused_moe", [(torch.float16, None), (torch.float32, True)])
def test_unpacked_experts_keep_their_weights(dtype, fused_moe):
    """Experts the kernel does not take (float16; forced onto the fused kernels) stay on their
    parameters: nothing is let go, the grouped path reads them."""
    experts = random_experts(dtype, fused_moe)
    kept = (experts.w13_weight.detach().clone(), experts.w2_weight.detach().clone())
    use_cpu_kernels(experts)
    assert experts.cpu_experts is None and not experts.weights_released
    assert torch.equal(experts.w13_weight, kept[0]) and torch.equal(experts.w2_weight, kept[1])
    if fused_moe is None:
        weights, ids = routings(5, 2, seed=5)
        with torch.no_grad():
            out = experts(torch.randn(5, H).to(dtype), weights.to(dtype), ids)
        assert out.isfinite().all()


def test_each_layers_experts_go_before_the_next_layer_packs(monkeypatch):
    """The load's peak: a layer's dense experts beside its panels, never every layer's (the
    memory check budgets one copy of the experts: a model whose experts fill half the RAM
    would pass it, then run out while its later layers packed)."""
    layers = torch.nn.ModuleList(random_experts(torch.float32) for _ in range(3))
    seen = []
    prepare = moe_experts.prepare

    def watched(*args, **kwargs):
        seen.append([e.weights_released for e in layers if e.cpu_experts is not None])
        return prepare(*args, **kwargs)

    monkeypatch.setattr(moe_experts, "prepare", watched)
    assert use_cpu_kernels(layers) == 6
    assert seen == [[], [True], [True, True]]
    assert all(e.weights_released for e in layers)
