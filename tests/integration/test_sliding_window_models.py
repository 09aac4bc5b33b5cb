"""Sliding-window models against transformers on the same tiny random weights (float32, CPU):
Mistral (window 8 on both layers) and Qwen2 with use_sliding_window (window 8 on layers 1 and
2, layer 0 full: max_window_layers 1), on every attention backend the CPU runs (torch, the CPU
paged kernel, Triton under the interpreter). Prefill logits of prompts five times the window;
chunked prefill then decodes far past the window (logits at every step); greedy tokens through
the in-process engine with chunked prefill (16 tokens a step) and prefix-cache hits.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu_paged
from kernels.attention.selector import get_attention_backend
from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.attention_cases import ON_GPU, needs_kernels
from tests.support.hf_reference import hf_model
from tests.support.window_schedule import (assert_chunks_and_decodes_match,
                                          assert_engine_greedy_with_prefix_hits)
from tests.support.paged_prefill import prefill_logits
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group

WINDOW = 8
CONFIGS = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  num_hidden_layers=3),
}
WINDOWS = {"mistral": [WINDOW, WINDOW], "qwen2": [0, WINDOW, WINDOW]}
ATOL = 1e-4


def cpu_kernel_or_skip():
    if not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")


# Triton runs these CPU models under the interpreter (a GPU machine compiles it instead)
TRITON = [pytest.mark.slow, needs_kernels,
          pytest.mark.skipif(ON_GPU, reason="the models run on the CPU: Triton interpreter only")]
BACKENDS = ["torch", "cpu", pytest.param("triton", marks=TRITON)]


@pytest.fixture
def windowed(tiny_models):
    """arch -> its model directory."""
    return lambda arch: tiny_models(arch, seed=4, **CONFIGS[arch])


def ours(path, backend: str):
    if backend == "cpu":
        cpu_kernel_or_skip()
    return load_model(path, single_rank_group(), get_attention_backend(backend, "cpu"), "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_prefill_logits_match_transformers(windowed, arch, backend):
    path = windowed(arch)
    model = ours(path, backend)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == WINDOWS[arch]
    ids = torch.arange(41) * 37 % 500 + 3
    expected = hf_logits(hf_model(path), ids)
    torch.testing.assert_close(prefill_logits(model, ids), expected, atol=ATOL, rtol=0)
    # the window matters here: without it the same weights answer differently
    for layer in model.model.layers:
        layer.self_attn.attn.sliding_window = 0
    assert (prefill_logits(model, ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_chunked_prefill_then_decodes_far_past_the_window(windowed, arch, backend):
    """Blocks of 4: chunks of 11, 16 and 5 (windows start mid-block), then 24 decodes, with a
    second request batched alongside; every step's logits equal transformers'."""
    path = windowed(arch)
    assert_chunks_and_decodes_match(ours(path, backend), hf_model(path), ATOL)


@pytest.mark.parametrize("backend,block_size", [("torch", 4), ("cpu", 4), ("cpu", 16),
                                                pytest.param("triton", 4, marks=TRITON)])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_engine_greedy_with_chunks_and_prefix_hits(windowed, arch, backend, block_size):
    """Prompts up to 130 tokens (16 windows), 16 tokens a step, a 70-token shared prefix: the
    greedy tokens equal transformers' generate() and the prefix cache was hit."""
    if backend == "cpu":
        cpu_kernel_or_skip()
    assert_engine_greedy_with_prefix_hits(windowed(arch), backend, block_size, arch)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=TRITON) for a in CONFIGS])
def test_fused_rope_writing_the_cache_keeps_the_window(windowed, arch):
    """fused_ops with the Triton backend: the rope launch writes the KV cache (kv_in_rope) and
    the backend, told kv_written, still applies each layer's window."""
    from kernels.attention.triton_backend import TritonAttentionBackend
    path = windowed(arch)
    model = load_model(path, single_rank_group(), TritonAttentionBackend(), "cpu", "float32",
                       fused_ops=True)
    assert all(layer.self_attn.kv_in_rope for layer in model.model.layers)
    ids = torch.arange(30) * 41 % 500 + 9
    torch.testing.assert_close(prefill_logits(model, ids), hf_logits(hf_model(path), ids),
                               atol=ATOL, rtol=0)
