"""The sparse MoE block (layers/moe.py, models/qwen_moe.py) against transformers' own Qwen3-MoE and
Qwen2-MoE blocks on the same random weights (float32), and its tensor-parallel slices.

Whole models (engine greedy tokens, prefill logits, TP=2 over gloo):
tests/integration/test_moe_vs_transformers.py."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from worker_service.layers.moe import MoEExperts, TopKRouter
from worker_service.models.qwen_moe import MoeArgs, SharedExpert, SparseMoeBlock
from worker_service.parallel_state import TPGroup, single_rank_group

H, E, K, I, SHARED = 32, 8, 2, 16, 24


def hf_block(arch: str, norm_topk_prob: bool, seed: int = 0):
    """transformers' sparse block with random weights (std 0.3, so routing is far from ties)."""
    common = dict(hidden_size=H, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                  norm_topk_prob=norm_topk_prob, num_attention_heads=4, num_key_value_heads=2)
    if arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(shared_expert_intermediate_size=SHARED, **common)
        block_class = tf.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock
    else:
        cfg = tf.Qwen3MoeConfig(**common)
        block_class = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    torch.manual_seed(seed)
    block = block_class(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return cfg, block


def checkpoint_tensors(block) -> dict[str, torch.Tensor]:
    """The block's weights under their per-expert checkpoint names (relative to `mlp.`)."""
    out = {"gate.weight": block.gate.weight}
    for e in range(E):
        gate, up = block.experts.gate_up_proj[e].chunk(2, dim=0)
        out[f"experts.{e}.gate_proj.weight"] = gate
        out[f"experts.{e}.up_proj.weight"] = up
        out[f"experts.{e}.down_proj.weight"] = block.experts.down_proj[e]
    if hasattr(block, "shared_expert"):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"shared_expert.{proj}.weight"] = getattr(block.shared_expert, proj).weight
        out["shared_expert_gate.weight"] = block.shared_expert_gate.weight
    return out


def our_block(cfg, theirs, tp: TPGroup) -> SparseMoeBlock:
    """Our block loaded through the same weight loaders the model loader calls."""
    moe = MoeArgs.from_hf(cfg.to_dict(), shared_expert=hasattr(theirs, "shared_expert"))
    block = SparseMoeBlock(moe, tp, torch.float32)
    params = dict(block.named_parameters())
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    for name, tensor in checkpoint_tensors(theirs).items():
        parts = name.split(".")
        if parts[0] == "experts":
            target, shard = f"experts.{'w2' if parts[2] == 'down_proj' else 'w13'}_weight", (
                int(parts[1]), parts[2])
        elif parts[0] == "shared_expert" and parts[1] in packed:
            target, shard = f"shared_expert.{packed[parts[1]][0]}.weight", packed[parts[1]][1]
        else:
            target, shard = name, None
        params[target].weight_loader(params[target], tensor.detach(), shard)
    return block


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_transformers(norm_topk_prob):
    cfg, theirs = hf_block("qwen3_moe", norm_topk_prob)
    router = TopKRouter(H, E, K, norm_topk_prob, torch.float32)
    router.weight.data.copy_(theirs.gate.weight)
    x = torch.randn(11, H)
    weights, ids = router(x)
    _, hf_weights, hf_ids = theirs.gate(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-6)
    assert weights.dtype == torch.float32
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(11))
    else:
        assert (weights.sum(-1) < 1).all()


@pytest.mark.parametrize("arch,norm", [("qwen3_moe", True), ("qwen3_moe", False),
                                       ("qwen2_moe", False)])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_block_matches_transformers(arch, norm, num_tokens):
    """1 token reaches 2 experts, 37 reach them all: the grouping and the skipped experts."""
    cfg, theirs = hf_block(arch, norm)
    ours = our_block(cfg, theirs, single_rank_group())
    x = torch.randn(num_tokens, H)
    with torch.no_grad():
        expected = theirs(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tp_slices_sum_to_the_whole_block(arch):
    """Each of 2 ranks keeps half of every expert's intermediate dim (and of the shared
    expert's); the ranks' partial sums add up to the single rank's output, which is what the
    block's one all-reduce computes."""
    cfg, theirs = hf_block(arch, norm_topk_prob=True)
    whole = our_block(cfg, theirs, single_rank_group())
    x = torch.randn(23, H)
    with torch.no_grad():
        expected = whole(x)
        total = torch.zeros_like(x)
        for rank in range(2):
            part = our_block(cfg, theirs, TPGroup(rank=rank, world_size=2))
            assert part.experts.w13_weight.shape == (E, I, H)       # 2 x I/2 rows
            assert part.experts.w2_weight.shape == (E, H, I // 2)
            weights, ids = part.gate(x)
            partial = part.experts(x, weights, ids)
            if part.shared_expert is not None:
                partial = partial + part.shared_expert_gate(x) * part.shared_expert(x)
            total += partial
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)


def test_expert_grouping_is_one_gemm_pair_per_used_expert(monkeypatch):
    """Tokens are grouped by expert: the gate/up GEMM runs once per expert that has tokens,
    however many tokens there are."""
    experts = MoEExperts(E, H, I, single_rank_group(), torch.float32)
    torch.nn.init.normal_(experts.w13_weight)
    torch.nn.init.normal_(experts.w2_weight)
    ids = torch.tensor([[0, 3]] * 50 + [[3, 5]] * 50)
    weights = torch.full(ids.shape, 0.5)
    calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda a, w, b=None: calls.append(a.shape[0]) or real_linear(a, w, b))
    out = experts(torch.randn(100, H), weights, ids)
    assert out.shape == (100, H)
    assert sorted(calls) == [50, 50, 50, 50, 100, 100]     # experts 0 and 5: 50 rows; 3: 100


def test_sparse_layers_follow_step_and_mlp_only_layers():
    cfg = {"hidden_size": H, "num_local_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    moe = MoeArgs.from_hf(cfg, shared_expert=False)
    assert moe.num_experts == 4                     # transformers 5's name for num_experts
    assert MoeArgs.from_hf({**cfg, "num_experts": 6}, False).num_experts == 6   # Hub's name
    assert [moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not MoeArgs.from_hf({**cfg, "num_local_experts": 0}, False).is_sparse(1)


def test_top_k_above_the_expert_count_is_refused():
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 is invalid"):
        TopKRouter(H, E, 9, True)


@pytest.mark.parametrize("field", ["num_experts", "num_local_experts"])
@pytest.mark.parametrize("top_k", [0, 5])
def test_config_top_k_outside_the_experts_is_refused_under_the_configs_names(field, top_k):
    cfg = {"hidden_size": H, field: 4, "num_experts_per_tok": top_k, "moe_intermediate_size": 8}
    with pytest.raises(ValueError, match=rf"^config.json: num_experts_per_tok={top_k} is "
                                         rf"invalid: must be in \[1, {field}=4\]$"):
        MoeArgs.from_hf(cfg, shared_expert=False)


def test_shared_expert_output_is_not_reduced():
    """SharedExpert returns the rank's partial sum: its down projection calls matmul, not the
    row-parallel forward that would all-reduce (here world_size 2 with no process group, so a
    reduce would raise)."""
    shared = SharedExpert(H, SHARED, TPGroup(rank=1, world_size=2), torch.float32, False)
    for p in shared.parameters():
        torch.nn.init.normal_(p)
    assert shared(torch.randn(5, H)).shape == (5, H)
