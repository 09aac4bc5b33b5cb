"""A mixture-of-experts model on the CPU with the deltaserve_cpu kernels (kernels/cpu): the dense
layers (attention projections, the dense MLP, Qwen2-MoE's shared expert, the LM head) take the
packed GEMMs, in a prefill (MKL) and a one-row decode (panels); the routed experts take their own
packed kernel (kernels/cpu/moe_experts.py) in both, their parameters let go (the panels are
their one copy), and a prefill past the kernel's row limit reads them back from the panels; the
logits still equal transformers'."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension
from tests.support.paged_prefill import load, prefill_logits
from tests.support.hf_reference import hf_model
from worker_service.layers.cpu_gemm import CpuGemm
from worker_service.layers.moe import MoEExperts

pytestmark = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_dense_layers_and_experts_take_the_cpu_kernels(tiny_models, arch):
    path = tiny_models(arch)
    model = load(path)
    gemms = {name: m for name, m in model.named_modules() if isinstance(m, CpuGemm)}
    assert all(m.cpu_linear is not None for m in gemms.values()), [
        n for n, m in gemms.items() if m.cpu_linear is None]
    names = set(gemms)
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
            "model.layers.1.mlp.gate_up_proj", "lm_head"} <= names
    assert ("model.layers.2.mlp.shared_expert.down_proj" in names) == (arch == "qwen2_moe")
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert len(experts) == 2 and not any(e.fused for e in experts)
    assert not any(isinstance(m, CpuGemm) for e in experts for m in e.modules())
    assert all(e.cpu_experts is not None and e.weights_released for e in experts)
    assert all(p.untyped_storage().nbytes() == 4 and p.isnan().all()
               for e in experts for p in (e.w13_weight, e.w2_weight))

    for n in (57, 1):                       # a prefill past the panels' rows, then one row
        ids = torch.arange(n) * 37 % 500 + 3
        calls = {name: m.cpu_linear.calls for name, m in gemms.items()}
        expert_calls = [e.cpu_experts.calls for e in experts]
        with torch.no_grad():
            expected = hf_model(path)(ids[None]).logits[0].float()
        torch.testing.assert_close(prefill_logits(model, ids), expected, rtol=0, atol=1e-4)
        assert all(m.cpu_linear.calls > calls[name] for name, m in gemms.items()), n
        # both, and every sparse layer, take the packed experts (57 x top-2 rows over 8 experts)
        assert [e.cpu_experts.calls - c for e, c in zip(experts, expert_calls)] == [1, 1], n


def test_a_long_prefill_reads_the_released_experts_from_the_panels(tiny_models):
    """300 tokens x top-2 over 8 experts is past MAX_MEAN_ROWS (64 rows an expert in float32):
    the grouped path runs, on each expert's weights read back from the panels, and the logits
    equal transformers' (a read of the NaN stand-ins would not)."""
    path = tiny_models("qwen3_moe")
    model = load(path)
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert experts and all(e.weights_released for e in experts)
    ids = torch.arange(300) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(model, ids), expected, rtol=0, atol=1e-4)
    assert all(e.cpu_experts.calls == 0 for e in experts)
