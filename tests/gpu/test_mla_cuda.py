"""On CUDA: DeepSeek's multi-head latent attention at the released latent (kv_lora_rank 512 +
qk_rope_head_dim 64 = 576 per token, padded to 1024 in the Triton kernels) over the stride-0
cache (its value half is its key half: one memory seen twice), through the Triton prefill and
decode kernels in the whole engine, tiny DeepSeek-V2 (q_proj, group-limited softmax routing)
and V3 (q LoRA, sigmoid routing, yarn), against transformers (the checks of
tests/gpu/family_checks.py): bf16 with decode graphs and eager, graphs equal to eager (the
fused MoE makes no host sync, so the steps capture), float32 equal to transformers.

CPU twins: tests/integration/test_deepseek_vs_transformers.py
(test_real_latent_size_through_chunks_and_decodes on Triton's interpreter; the engine's greedy
tests); the engine path under the interpreter: tests/gpu/test_cuda_twins_interpreted.py. The
1024-wide kernels compile slowest: the kit runs this module after the others. Their launches
take the wide-head tiles (kernels/attention/triton_launch.py), which compiled for sm_90 fit its
shared memory (tests/gpu/test_mla_kernel_fit.py: 66,048 bytes in bf16, 132,160 in float32).
Marked `gpu`; skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu import family_checks as checks
from tests.gpu.family_checks import Family

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LATENT_576 = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64}
FAMILIES = {f"{arch}-576": Family(arch, LATENT_576, 576, shared_halves=True)
            for arch in ("deepseek_v3", "deepseek_v2")}
NAMES = list(FAMILIES)


@pytest.fixture(scope="module")
def family_run(tiny_models):
    return checks.runs(tiny_models, FAMILIES)


@pytest.mark.parametrize("name", NAMES)
def test_cache_layout_on_cuda(family_run, name):
    checks.check_layout(FAMILIES[name], family_run(name, "bfloat16", True)[1])


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", NAMES)
def test_bf16_matches_transformers(family_run, name, enforce_eager):
    path, run = family_run(name, "bfloat16", enforce_eager)
    checks.check_bf16_run(name, path, run, enforce_eager)


@pytest.mark.parametrize("name", NAMES)
def test_graphs_replay_and_equal_eager(family_run, name):
    checks.check_graphs(name, FAMILIES[name], family_run(name, "bfloat16", False)[1],
                        family_run(name, "bfloat16", True)[1])


@pytest.mark.parametrize("name", NAMES)
def test_fp32_matches_transformers(family_run, name):
    checks.check_fp32_run(name, *family_run(name, "float32", False))
