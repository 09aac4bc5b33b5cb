"""On CUDA, through the whole engine on the Triton backend against transformers (the checks of
tests/gpu/family_checks.py), the hybrid KV cache and partial rotary added in sessions 44-46:

  gemma2, gpt_oss  window 8 / full layers in two pools with two block tables, Gemma 2's
                   softcaps, GPT-OSS's attention sinks; decode graphs are refused (they take
                   one block table; GPT-OSS's experts sync with the host, which is said
                   first), the refusal is logged and the eager run is correct.
                   CPU twin: tests/integration/test_hybrid_kv_models.py.
  phi3-partial     partial_rotary_factor 0.75 (12 of 16 dims rotate) in the fused rope with
                   its KV write; decode graphs captured and equal to eager.
                   CPU twin: tests/integration/test_partial_rotary_vs_transformers.py.

The same engine path (Triton attention, fused ops, async scheduling: the CUDA defaults) runs on
the CPU under TRITON_INTERPRET in tests/gpu/test_cuda_twins_interpreted.py. Marked `gpu`;
skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu import family_checks as checks
from tests.gpu.family_checks import Family

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FAMILIES = {
    "gemma2": Family("gemma2", {}, 16, hybrid=True,
                     graphs_refused="a hybrid KV cache (the graphs take one block table)"),
    "gpt_oss": Family("gpt_oss", {}, 16, hybrid=True,
                      graphs_refused="the model cannot be captured (GPT-OSS experts"),
    "phi3-partial": Family("phi3", {"partial_rotary_factor": 0.75, "sliding_window": None},
                           16),
}
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
def test_graphs_replay_or_are_refused_by_name(family_run, name):
    checks.check_graphs(name, FAMILIES[name], family_run(name, "bfloat16", False)[1],
                        family_run(name, "bfloat16", True)[1])


@pytest.mark.parametrize("name", NAMES)
def test_fp32_matches_transformers(family_run, name):
    checks.check_fp32_run(name, *family_run(name, "float32", False))
