"""kernels/cpu/csrc/moe_experts.cpp with GPT-OSS's experts (per-expert gate_up and down biases,
the clamped SwiGLU) against the grouped torch path of worker_service/layers/gpt_oss_moe.py, once
per body this machine runs: 1 to 300 tokens, one expert never routed to (most of them at one
token), partial panels; float32 within rounding, bfloat16 to the bit (the same roundings).
The model against transformers: tests/integration/test_gpt_oss_cpu_packed.py."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension, moe_experts
from worker_service.layers.cpu_kernels import use_cpu_kernels
from worker_service.layers.gpt_oss_moe import GptOssExperts
from worker_service.parallel_state import single_rank_group

pytestmark = [pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built"),
              pytest.mark.usefixtures("cpu_isa")]

E, H, INTER, TOP_K = 6, 40, 20, 2
ALPHA, LIMIT = 1.702, 1.5      # a low limit, so both clamps bite on these weights


def gpt_oss_experts(dtype: torch.dtype) -> GptOssExperts:
    m = GptOssExperts(E, H, INTER, single_rank_group(), dtype, ALPHA, LIMIT)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p, std in ((m.w13_weight, 0.4), (m.w13_bias, 1.0), (m.w2_weight, 0.3),
                       (m.w2_bias, 1.0)):
            p.copy_(std * torch.randn(p.shape, generator=gen))
    assert m.use_cpu_kernels()
    return m


def kernel_and_grouped(m: GptOssExperts, x, weights, ids):
    """(the packed kernel's output, the grouped torch path's) on the same inputs."""
    packed = m.cpu_experts
    with torch.no_grad():
        got = packed(x, weights, ids, moe_experts.ClampedSwiGLU(m.alpha, m.limit))
        m.cpu_experts = None
        try:
            want = m(x, weights, ids)
        finally:
            m.cpu_experts = packed
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 33, 128, 300])
def test_equals_the_grouped_path(dtype, num_tokens):
    m = gpt_oss_experts(dtype)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen).softmax(-1).to(dtype)
    got, want = kernel_and_grouped(m, x, weights, ids)
    assert got.dtype == dtype and got.shape == (num_tokens, H)
    assert m.cpu_experts.calls == 1
    # bfloat16 rounds where the torch path rounds (after F.linear with its bias, after each
    # elementwise op of the SwiGLU): the same bits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if dtype == torch.float32 else 0)


def test_forward_takes_the_kernel_with_the_limit_of_the_call():
    """forward takes the packed path and reads alpha / limit when called (a test that lifts the
    limit sees the change without repacking)."""
    m = gpt_oss_experts(torch.float32)
    x = torch.randn(9, H)
    ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(9)])
    weights = torch.rand(9, TOP_K).softmax(-1)
    with torch.no_grad():
        clamped = m(x, weights, ids)
        m.limit = 1e9
        unclamped = m(x, weights, ids)
    assert m.cpu_experts.calls == 2
    assert (clamped - unclamped).abs().max() > 1e-2
    got, want = kernel_and_grouped(m, x, weights, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_bad_biases_and_activations_are_refused():
    m = gpt_oss_experts(torch.float32)
    packed, ops = m.cpu_experts, extension.ops()
    args = (torch.randn(2, H), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long),
            packed.w13_panels, packed.w2_panels, INTER)
    shape = r"must be a contiguous float32 CPU tensor \[6, 40\]"
    with pytest.raises(RuntimeError, match="w13_bias " + shape):
        ops.moe_experts(*args, packed.w13_bias[:, :INTER], None, "clamped_swiglu", 1.0, 7.0)
    with pytest.raises(RuntimeError, match="w2_bias " + shape):
        ops.moe_experts(*args, None, packed.w2_bias.bfloat16(), "silu", 0.0, 0.0)
    with pytest.raises(RuntimeError, match=r"activation='gelu' is not one of 'silu', "):
        ops.moe_experts(*args, None, None, "gelu", 0.0, 0.0)
    with pytest.raises(RuntimeError, match=r"a limit >= 0, got alpha=1(\.0*)? limit=-1"):
        ops.moe_experts(*args, None, None, "clamped_swiglu", 1.0, -1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_experts_run_a_long_prefill_on_the_panels(dtype):
    """After the model's use_cpu_kernels the stacked weights are NaN stand-ins (the biases
    stay); a prefill past the row limit takes the grouped path with its GEMMs on the panels
    (CpuExperts.expert_linear): the grouped path on the dense weights up to the order of the
    sums (float32 to ~1e-6; bfloat16 within one rounding)."""
    m, ref = gpt_oss_experts(dtype), gpt_oss_experts(dtype)
    ref.cpu_experts = None
    use_cpu_kernels(m)
    assert m.weights_released and m.w13_weight.isnan().all() and m.w2_weight.isnan().all()
    assert m.w13_bias.isfinite().all() and m.w2_bias.isfinite().all()
    tokens = moe_experts.MAX_MEAN_ROWS[dtype] * E // TOP_K + 1
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen).softmax(-1).to(dtype)
    with torch.no_grad():
        got, want = m(x, weights, ids), ref(x, weights, ids)
    assert m.cpu_experts.calls == 0 and got.isfinite().all()
    torch.testing.assert_close(got, want)
