"""GPT-OSS's routed experts on the CPU's packed kernel (kernels/cpu/moe_experts.py with the
biases and the clamped SwiGLU): loaded on the CPU, every layer's experts are packed and take the
kernel; the in-process engine's greedy tokens equal transformers' generate() in float32 (chunked
prefills batched with decodes, every step on the packed path); two tensor-parallel ranks' packed
partial sums (each half of every expert, the down bias on rank 0 only) add up to transformers'
GptOssExperts. The kernel alone against the grouped path: tests/unit/kernels/cpu/
test_moe_experts_gpt_oss.py."""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from kernels.cpu import extension
from tests.support.engine_checks import _check, _prompts
from worker_service.layers.gpt_oss_moe import GptOssExperts
from worker_service.parallel_state import TPGroup

pytestmark = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


def test_engine_greedy_on_the_packed_experts_matches_transformers(tiny_models):
    path = tiny_models("gpt_oss")
    llm = LLM(path, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    experts = [m for m in llm.runner.model.modules() if isinstance(m, GptOssExperts)]
    assert len(experts) == 3 and all(e.cpu_experts is not None for e in experts)
    _check(llm, path, _prompts(llm.model_info.vocab_size), "gpt_oss/packed experts")
    # 24 tokens a step x top-2 stays within MAX_MEAN_ROWS: every step took the kernel
    assert all(e.cpu_experts.calls > 10 for e in experts), [e.cpu_experts.calls for e in experts]


def hf_experts(num_experts: int, hidden: int, inter: int):
    """transformers' GptOssExperts with random weights and biases, limit 1.5 (the clamps bite)."""
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HfExperts

    cfg = tf.GptOssConfig(num_local_experts=num_experts, hidden_size=hidden,
                          intermediate_size=inter, swiglu_limit=1.5)
    theirs = HfExperts(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return cfg, theirs


def our_rank(cfg, theirs, tp: TPGroup) -> GptOssExperts:
    """One rank's experts, loaded through the checkpoint loaders, packed."""
    ours = GptOssExperts(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, tp,
                         torch.float32, cfg.swiglu_alpha, cfg.swiglu_limit)
    for param, loaded in ((ours.w13_weight, theirs.gate_up_proj),
                          (ours.w13_bias, theirs.gate_up_proj_bias),
                          (ours.w2_weight, theirs.down_proj),
                          (ours.w2_bias, theirs.down_proj_bias)):
        param.weight_loader(param, loaded.data)
    assert ours.use_cpu_kernels()
    return ours


def test_tp2_packed_partial_sums_add_up_to_transformers_experts():
    cfg, theirs = hf_experts(num_experts=5, hidden=48, inter=40)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, 48, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(7)])  # expert 4: none
    weights = torch.rand(7, 2, generator=gen).softmax(-1)
    with torch.no_grad():
        expected = theirs(x, ids, weights)
        total = torch.zeros_like(x)
        for rank in range(2):
            part = our_rank(cfg, theirs, TPGroup(rank=rank, world_size=2))
            assert (part.cpu_experts.w2_bias is None) == (rank == 1)   # added by rank 0 only
            total += part(x, weights, ids)
            assert part.cpu_experts.calls == 1
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)
