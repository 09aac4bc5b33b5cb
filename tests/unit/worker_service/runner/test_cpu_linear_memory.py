"""runner/cpu_linear_memory.py: the estimate of what a CPU rank's prepared dense linears hold
beyond one copy of their weights (panels, packs, a tied head's kept parameter) against the
real bytes of a loaded tiny model's CpuLinears."""
from __future__ import annotations

import pytest
import torch

from engine_common.model_files.model_dir import ModelInfo
from kernels.attention.torch_ref import TorchAttentionBackend
from kernels.cpu import extension, linear
from worker_service.models.loader import load_model
from worker_service.parallel_state import TPGroup, single_rank_group
from worker_service.runner.cpu_linear_memory import extra_copy_bytes
from worker_service.runner.memory_fit import estimate_cpu_linear_bytes

needs_extension = pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")


def _held_beyond_one_copy(model) -> int:
    """Every CpuLinear's panels and pack (an MKL pack counted as the dense bytes it writes: it
    reserves more), the AVX2 head's screen, plus its parameter where it stays, less one dense copy of each (what the
    plain weight estimate counts); a tied head's parameter is the embedding's copy."""
    embedding = model.model.embed_tokens.weight
    total = 0
    for m in model.modules():
        lin = getattr(m, "cpu_linear", None)
        if not isinstance(lin, linear.CpuLinear):
            continue
        dense = m.weight.numel() * m.weight.element_size()
        pack = dense if lin.onednn is not None or lin.packed is not None or lin.tiles else 0
        kept = m.weight.untyped_storage().nbytes() if m.weight is not embedding else 0
        screen = sum(t.nbytes for t in lin.screen) if lin.screen is not None else 0
        total += lin.panels.nbytes + pack + screen + (kept if kept > 8 else 0) - dense
        if m.weight is embedding:
            total += dense
    return total


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "starcoder2", "deepseek_v2",
                                  "deepseek_v3"])
@pytest.mark.parametrize("tied", [True, False])
def test_the_estimate_is_a_close_lower_bound_of_the_real_copies(tiny_models, arch, dtype, tied):
    """Dense and tied heads, a shared expert, two-matrix MLPs, latent attention (its q, kv_a
    and o projections run as linears, kv_b does not), float32 and bfloat16: the estimate is
    at most the real bytes and within the panels' padding of them."""
    path = tiny_models(arch, tie_word_embeddings=tied)
    model = load_model(path, single_rank_group(), TorchAttentionBackend(), "cpu",
                       str(dtype).split(".")[1])
    assert model.lm_head_is_tied == tied
    real = _held_beyond_one_copy(model)
    estimate = estimate_cpu_linear_bytes(ModelInfo.from_dir(path).hf_config, dtype)
    assert 0.9 * real <= estimate <= real, (estimate, real)


def test_a_dtype_the_kernels_do_not_take_adds_nothing():
    assert extra_copy_bytes(100, 10, torch.float16, True) == 0
    assert extra_copy_bytes(100, 10, torch.float32, False) == 120 * 4
    assert extra_copy_bytes(100, 10, torch.bfloat16, False) == 110 * 2   # the bf16 GEMM's W


@needs_extension
def test_a_pooling_only_decoder_packs_no_head(tmp_path):
    """A decoder classifier (Qwen3ForSequenceClassification) has no head in its checkpoint:
    the loader ties one to the embedding, which nothing reads (compute_logits refuses), so
    it gets no panels or pack, and the estimate counts none (it counted one copy of an
    untied head: config.json says tie_word_embeddings false)."""
    from tests.support.classifier_models import make_classifier_model

    path = make_classifier_model(tmp_path / "qwen3", "qwen3", 2)
    model = load_model(path, single_rank_group(), TorchAttentionBackend(), "cpu", "float32")
    assert model.lm_head_is_tied and model.lm_head.cpu_linear is None
    assert model.model.layers[0].mlp.down_proj.cpu_linear is not None
    real = _held_beyond_one_copy(model)
    estimate = estimate_cpu_linear_bytes(ModelInfo.from_dir(path).hf_config, torch.float32)
    assert 0.9 * real <= estimate <= real, (estimate, real)


@needs_extension
@pytest.mark.parametrize("arch, overrides", [("llama", {"num_key_value_heads": 1}),
                                             ("deepseek_v2", {})])
def test_one_rank_of_two_holds_what_the_estimate_counts(tiny_models, arch, overrides):
    """Rank 0 of two, loaded alone (loading takes no collectives): what every rank holds
    whole is not halved, k / v when there are fewer kv heads than ranks (each keeps one), a
    latent attention's q_a / kv_a (replicated)."""
    path = tiny_models(arch, **overrides)
    model = load_model(path, TPGroup(0, 2), TorchAttentionBackend(), "cpu", "float32")
    real = _held_beyond_one_copy(model)
    estimate = estimate_cpu_linear_bytes(ModelInfo.from_dir(path).hf_config, torch.float32, 2)
    assert 0.95 * real <= estimate <= real, (estimate, real)
