"""On CUDA: the fused MoE experts (kernels/fused_moe.py) make no host sync, a CUDA graph captures
them, and a replay with another routing written into the same input buffers gives what an eager
call gives, in bf16 and float32, at Qwen3-30B-A3B's expert shapes scaled down (128 experts,
top-8) and at a decode batch's sizes; a prefill-sized batch (the argsort ranks) makes no sync
either; fused against the grouped path on CUDA. Marked `gpu`; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

E, K, H, I = 128, 8, 256, 96


def inputs(num_tokens: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, E, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    x = torch.randn(num_tokens, H, device="cuda", generator=gen).to(dtype)
    return x, weights.to(dtype), ids


def stacked(dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = 0.1 * torch.randn(E, 2 * I, H, device="cuda", generator=gen)
    w2 = 0.1 * torch.randn(E, H, I, device="cuda", generator=gen)
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 16, 256])
def test_graph_replay_matches_eager_without_a_sync(num_tokens, dtype):
    from kernels.fused_moe import fused_experts

    w13, w2 = stacked(dtype)
    x, weights, ids = inputs(num_tokens, dtype, seed=1)
    fused_experts(x, w13, w2, weights, ids)             # compile outside the capture
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_experts(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_experts(x, w13, w2, weights, ids)
    for seed in (2, 3):                     # new routings into the captured buffers
        new_x, new_w, new_ids = inputs(num_tokens, dtype, seed)
        if seed == 3:
            new_ids = torch.zeros_like(new_ids) + torch.arange(K, device="cuda")   # crowded
        x.copy_(new_x)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, fused_experts(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_matches_the_grouped_path_on_cuda(dtype, tol):
    from worker_service.layers.moe import MoEExperts
    from worker_service.parallel_state import single_rank_group

    m = MoEExperts(E, H, I, single_rank_group(), dtype, fused_moe=False).cuda()
    m.w13_weight.data, m.w2_weight.data = stacked(dtype)
    x, weights, ids = inputs(200, dtype, seed=4)
    with torch.no_grad():
        want = m(x, weights, ids)
        m.fused_moe = None
        assert m.fused                                  # CUDA weights pick the kernels
        got = m(x, weights, ids)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err.item() <= tol


def test_a_prefill_sized_batch_makes_no_sync_either():
    """5000 tokens x top-8 over 128 experts is past moe_align's one-hot limit: the argsort
    ranks the pairs. Eager (prefill steps are not captured), but still no host sync, and the
    same result as the one-hot ranks."""
    from kernels import moe_align
    from kernels.fused_moe import fused_experts

    w13, w2 = stacked(torch.bfloat16)
    x, weights, ids = inputs(5000, torch.bfloat16, seed=5)
    assert ids.numel() * E > moe_align.ONE_HOT_MAX_ELEMENTS
    want = fused_experts(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fused_experts(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert torch.equal(got, want)
    halves = [fused_experts(x[i:i + 2500], w13, w2, weights[i:i + 2500], ids[i:i + 2500])
              for i in (0, 2500)]                     # one-hot ranks (under the limit)
    torch.testing.assert_close(torch.cat(halves), want)     # bf16 defaults
