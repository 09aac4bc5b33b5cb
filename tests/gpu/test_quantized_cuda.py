"""On CUDA: weight-quantized checkpoints (FP8 block-wise, GPTQ 4-bit with act order, AWQ 4-bit;
tests/support/quant_models.py) load
dequantized on the device and serve exactly as their dequantized twins: the same bfloat16
weights bit for bit, and the same greedy tokens through the engine (Triton backend, decode
graphs). The CUDA twin of tests/integration/test_quantized_checkpoints.py (same weights,
greedy equal to transformers on the twin in float32 on the CPU). Marked `gpu`; skipped without
CUDA.

Same weights and the same kernels in one process make the same tokens, so the check is
equality, no tolerance: a difference is a weight the CUDA load reads or rounds otherwise.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.quant_models import make_quantized_pair

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# max_num_seqs 8: graphs for 1, 2, 4 and 8 (fewer captures than the bf16 scenario's 16)
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
# the formats whose load differs (FP8 blocks, GPTQ act order, AWQ's packing); DeepSeek-V3's
# released format on its MoE and latent attention
CASES = [("qwen3", "fp8"), ("qwen3", "gptq"), ("qwen3", "awq"), ("deepseek_v3", "fp8")]


def weights(runner) -> dict[str, torch.Tensor]:
    """The model's parameters as loaded on the device."""
    return {n: p.detach().clone() for n, p in runner.model.named_parameters()}


@pytest.mark.parametrize("arch,fmt", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_quantized_serves_as_its_dequantized_twin(tiny_models, tmp_path, arch, fmt):
    from tests.gpu.engine_runs import run_engine

    quantized, twin = make_quantized_pair(tiny_models(arch), tmp_path / arch, fmt)
    got = run_engine(str(quantized), "bfloat16", False, probe=weights, **ENGINE)
    want = run_engine(str(twin), "bfloat16", False, probe=weights, **ENGINE)
    assert got.probed.keys() == want.probed.keys()
    for name, w in want.probed.items():
        g = got.probed[name]
        assert g.device.type == "cuda" and g.dtype == w.dtype == torch.bfloat16, name
        assert torch.equal(g, w), f"{name}: max diff {(g.float() - w.float()).abs().max()}"
    assert got.graphs_off is None and got.replays > 0, got.graphs_off
    for i, (a, b) in enumerate(zip(got.tokens, want.tokens)):
        assert a == b, f"{arch}/{fmt} prompt {i}: quantized {a} != twin {b}"
