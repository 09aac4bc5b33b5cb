"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with its shared expert) against transformers on
the same tiny random weights, float32 on the CPU: 3 layers, layer 1 dense (mlp_only_layers), the
others routing each token to 2 of 8 experts (worker_service/models/tiny_model.py).

  - prefill logits through the paged cache equal transformers' forward (also with fused_ops,
    and with the experts on the fused MoE kernels),
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes,
  - two gloo ranks (each with half of every expert) give the single rank's logits.
"""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from tests.support.engine_checks import _check, _prompts
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import BACKEND, assert_tp2_matches_tp1, load, prefill_logits
from worker_service.models.loader import load_model
from worker_service.models.tiny_model import make_tiny_model
from worker_service.parallel_state import single_rank_group

MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefill_logits_match_transformers(tiny_models, arch):
    path = tiny_models(arch)
    ours = load(path)
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == [
        "SparseMoeBlock", "DecoderMLP", "SparseMoeBlock"]
    ids = torch.arange(57) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    got = prefill_logits(ours, ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_fused_ops_logits_match_transformers(tiny_models):
    """fused_ops=True: the experts' and the shared expert's SiLU-and-mul (and the norms and
    rope) as Triton kernels, under the interpreter on CPU (so the prompt stays short)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: Triton compiles for the GPU, not the CPU interpreter")
    from tests.support.triton_mode import interpreted
    if not interpreted():
        pytest.skip("triton was imported in compiled mode (TRITON_INTERPRET unset)")
    path = tiny_models("qwen2_moe")
    ours = load_model(path, single_rank_group(), BACKEND, "cpu", fused_ops=True)
    assert ours.model.layers[0].mlp.experts.act_fn._fused_kernel is not None
    ids = torch.arange(9) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_moe_logits_match_transformers(tiny_models, arch):
    """The experts on kernels/fused_moe.py (the CUDA path; forced here, the Triton interpreter
    on CPU): the same logits, and nothing left to keep CUDA graphs from capturing the model."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: Triton compiles for the GPU, not the CPU interpreter")
    from tests.support.triton_mode import interpreted
    if not interpreted():
        pytest.skip("triton was imported in compiled mode (TRITON_INTERPRET unset)")
    from worker_service.layers.moe import MoEExperts
    path = tiny_models(arch)
    ours = load(path)
    assert ours.graph_capture_blocker                  # CPU weights: the grouped path
    for m in ours.modules():
        if isinstance(m, MoEExperts):
            m.fused_moe = True
    assert ours.graph_capture_blocker is None
    ids = torch.arange(13) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_greedy_matches_transformers(tiny_models, arch):
    model = tiny_models(arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=256)
    _check(llm, model, _prompts(llm.model_info.vocab_size), f"{arch}/plain")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_chunked_prefill_matches_transformers(tiny_models, arch):
    """24 tokens a step: prompts prefill in chunks, in the same steps as other requests' decodes,
    so the experts see mixed batches."""
    model = tiny_models(arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, model, _prompts(llm.model_info.vocab_size), f"{arch}/chunked")


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    """Each rank holds half of every expert's (and the shared expert's) intermediate dim; the
    block's single all-reduce sums the halves."""
    paths = [make_tiny_model(tmp_path / arch, arch=arch, seed=2) for arch in MOE_ARCHS]
    assert_tp2_matches_tp1(paths, tmp_path)
