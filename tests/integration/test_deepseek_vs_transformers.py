"""DeepSeek-V2 and V3 (worker_service/models/deepseek.py: MLA over the latent KV cache, the grouped
routers, shared experts) against transformers on the same tiny random weights, float32 on the CPU
(worker_service/models/tiny_model.py: 3 layers, layer 0 dense, 1 and 2 sparse; V2 with q_proj and
group-limited softmax routing, V3 with the q LoRA, sigmoid routing with its correction bias and
yarn with DeepSeek's mscale):

  - prefill logits through the paged cache equal transformers' forward, with the config variants
    that change the computation (rope_interleave off, greedy V2 routing, V2 with q_lora_rank,
    a plain rope, no dense layer, one expert group), on the torch backend and on the C++ CPU
    kernel (whose latent head sizes it takes; the others attend on the torch backend;
    test_deepseek_cpu_kernel.py runs the engine on it), and
    with fused_ops (Triton's interpreter),
  - the cache holds one latent head per token (kv_lora_rank + qk_rope_head_dim),
  - the in-process engine's greedy tokens equal transformers' generate(), whole and chunked
    prefills batched with decodes, and with prefix-cache hits,
  - the released models' latent (kv_lora_rank 512 + qk_rope_head_dim 64 = 576, no power of two)
    gives transformers' logits step by step through chunked prefills and decodes on the torch
    backend and on Triton's (interpreter on the CPU, slow lane),
  - two and three gloo ranks (each a share of the heads and of every expert) give the single
    rank's logits.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltaserve.llm import LLM
from kernels.cpu import extension
from tests.support.engine_checks import _check, _prompts, check_greedy_and_prefix_hits
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import (BACKEND, assert_tp2_matches_tp1, load,
                                        prefill_logits)
from tests.support.window_schedule import TRITON, assert_chunks_and_decodes_match
from kernels.attention.selector import get_attention_backend
from worker_service.layers.mla import MLAAttention
from worker_service.models.loader import load_model
from worker_service.models.tiny_model import make_tiny_model
from worker_service.parallel_state import single_rank_group

ARCHS = ("deepseek_v2", "deepseek_v3")
VARIANTS = [
    ("deepseek_v3", {"rope_interleave": False}),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                     "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
                     "norm_topk_prob": False}),
    ("deepseek_v2", {"topk_method": "greedy", "q_lora_rank": 24}),
]


def assert_logits_match(path: str, model=None, n: int = 57) -> None:
    ours = model if model is not None else load(path)
    ids = torch.arange(n) * 37 % 500 + 3
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    got = prefill_logits(ours, ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_models, arch):
    path = tiny_models(arch)
    ours = load(path)
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == [
        "DecoderMLP", "DeepseekMoeBlock", "DeepseekMoeBlock"]
    # the latent cache: one head of kv_lora_rank 48 + qk_rope_head_dim 16
    assert (ours.num_kv_heads, ours.head_dim) == (1, 64)
    assert_logits_match(path, ours)


@pytest.mark.parametrize("arch,overrides", VARIANTS, ids=lambda v: str(v))
def test_config_variants_match_transformers(tiny_models, arch, overrides):
    assert_logits_match(tiny_models(arch, **overrides))


def test_fused_ops_logits_match_transformers(tiny_models):
    """fused_ops=True: the latent norms, the rope over the rope dims, the experts' SiLU-and-mul
    as Triton kernels, under the interpreter on CPU (so the prompt stays short)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: Triton compiles for the GPU, not the CPU interpreter")
    from tests.support.triton_mode import interpreted
    if not interpreted():
        pytest.skip("triton was imported in compiled mode (TRITON_INTERPRET unset)")
    path = tiny_models("deepseek_v3")
    ours = load_model(path, single_rank_group(), BACKEND, "cpu", fused_ops=True)
    attn = ours.model.layers[1].self_attn
    assert attn.kv_a_layernorm._fused_kernel is not None and attn.rotary_emb.fused
    assert_logits_match(path, ours, n=9)


@pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")
@pytest.mark.parametrize("arch", ARCHS)
def test_cpu_kernel_backend_matches_transformers(tiny_models, arch):
    from kernels.attention.cpu_paged import CpuPagedAttentionBackend
    path = tiny_models(arch)
    backend = CpuPagedAttentionBackend()
    ours = load_model(path, single_rank_group(), backend, "cpu")
    assert_logits_match(path, ours)
    assert backend.calls == 3                          # every layer on the kernel


@pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")
def test_latent_size_the_cpu_kernel_lacks_runs_and_is_reported_as_torch(tiny_models):
    """kv_lora_rank 40 + 16 = 56, not a size the kernel takes: `auto` picks torch, the runner
    reports torch and the layers attend on torch; `cpu` named for it is refused by name, by the
    runner's preflight and by the model itself (never swapped for another backend)."""
    from kernels.attention.cpu_paged import CpuPagedAttentionBackend
    from kernels.attention.torch_ref import TorchAttentionBackend
    from worker_service.config import RunnerConfig
    from worker_service.runner.model_runner import ModelRunner
    from worker_service.runner.preflight import check_runner_config
    path = tiny_models("deepseek_v3", kv_lora_rank=40)
    runner = ModelRunner(RunnerConfig(model_dir=path, device="cpu", dtype="float32",
                                      num_kv_blocks=16))
    assert runner.attention_backend_name == "torch"
    layers = [m for m in runner.model.modules() if isinstance(m, MLAAttention)]
    assert layers and all(isinstance(m.attn.backend, TorchAttentionBackend) for m in layers)
    assert runner.model.head_dim == 56
    explicit = RunnerConfig(model_dir=path, device="cpu", dtype="float32", num_kv_blocks=16,
                            attention_backend="cpu")
    with pytest.raises(ValueError, match=r"attention_backend='cpu' is invalid .* head size 56"):
        check_runner_config(explicit)
    with pytest.raises(ValueError, match=r"attention_backend='cpu' is invalid .* head size 56"):
        load_model(path, single_rank_group(), CpuPagedAttentionBackend(), "cpu")


@pytest.mark.skipif(not extension.load(), reason="deltaserve_cpu not built")
def test_more_heads_than_the_cpu_kernel_groups_is_reported_as_torch(tiny_models):
    """64 heads on the one latent head fit the kernel (head tiles of 48 past 48); 130 (over its
    128 per kv head) do not: `auto` picks torch at TP=1 and the kernel at TP=2 (65 a rank);
    `cpu` named for 130 at TP=1 is refused by name."""
    from kernels.attention.selector import resolve_backend_name
    from worker_service.config import RunnerConfig
    from worker_service.runner.model_runner import cache_layout
    from worker_service.runner.preflight import check_runner_config
    path = tiny_models("deepseek_v3", num_attention_heads=64, num_key_value_heads=64)
    hf_config = json.loads(Path(path, "config.json").read_text())
    one = RunnerConfig(model_dir=path, device="cpu", dtype="float32", num_kv_blocks=16)
    assert resolve_backend_name("auto", "cpu", cache_layout(hf_config, one)) == "cpu"
    wide = {**hf_config, "num_attention_heads": 130, "num_key_value_heads": 130}
    assert resolve_backend_name("auto", "cpu", cache_layout(wide, one)) == "torch"
    assert resolve_backend_name("auto", "cpu", cache_layout(wide, one, tp_size=2)) == "cpu"
    path = tiny_models("deepseek_v3", num_attention_heads=130, num_key_value_heads=130)
    with pytest.raises(ValueError, match="130 query heads per kv head on a rank"):
        check_runner_config(RunnerConfig(model_dir=path, device="cpu", dtype="float32",
                                         num_kv_blocks=16, attention_backend="cpu"))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=TRITON)])
def test_real_latent_size_through_chunks_and_decodes(tiny_models, backend):
    path = tiny_models("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64,
                       head_dim=64)
    model = load_model(path, single_rank_group(), get_attention_backend(backend, "cpu"), "cpu")
    assert model.head_dim == 576
    # the absorbed query sums over 512 latent dims, transformers over 128 + 64: fp32 order
    assert_chunks_and_decodes_match(model, hf_model(path), 3e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_models, arch):
    model = tiny_models(arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=256)
    _check(llm, model, _prompts(llm.model_info.vocab_size), f"{arch}/plain")


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_transformers(tiny_models, arch):
    """24 tokens a step: prompts prefill in chunks next to other requests' decodes."""
    model = tiny_models(arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, model, _prompts(llm.model_info.vocab_size), f"{arch}/chunked")


def test_prefix_cache_hits_match_transformers(tiny_models):
    check_greedy_and_prefix_hits(tiny_models("deepseek_v3"), "deepseek_v3/prefix")


@pytest.mark.slow
def test_tp2_matches_tp1_over_gloo(tmp_path):
    """Each rank holds half of the heads (q_b/q_proj, kv_b rows, o columns) and of every
    expert's width; the latent projections are replicated, so both cache the same latents."""
    paths = [make_tiny_model(tmp_path / arch, arch=arch, seed=2) for arch in ARCHS]
    assert_tp2_matches_tp1(paths, tmp_path)


@pytest.mark.slow
def test_tp3_matches_tp1_over_gloo(tmp_path):
    """Three ranks: 6 heads (2 a rank: q, kv_b rows, o columns), every expert 48 wide (16 a
    rank), the dense MLP 96 (32 a rank); the routers and their groups replicated."""
    shapes = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6,
              "moe_intermediate_size": 48}
    paths = [make_tiny_model(tmp_path / arch, arch=arch, seed=5, **shapes) for arch in ARCHS]
    assert_tp2_matches_tp1(paths, tmp_path, world_size=3)
