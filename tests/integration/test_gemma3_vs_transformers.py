"""Gemma 3 text (Gemma3ForCausalLM) against transformers on the same tiny random weights
(float32, CPU). The tiny model (models/tiny_model.py "gemma3"): 3 layers sliding (window 8),
full, sliding; the full layer's rope theta 1e6 with linear scaling x8, the sliding layers' 1e4;
attention scale 24 ** -0.5 with head_dim 16; tied embeddings.

On the torch backend, the CPU paged kernel and Triton under the interpreter: prefill logits of
a prompt five windows long; chunked prefill then decodes far past the window (logits at every
step); greedy tokens through the in-process engine with chunked prefill and prefix-cache hits;
the fused rope writing the cache; a final-logit softcap; TP=2 with one replicated kv head.
"""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from kernels.attention import cpu_paged
from kernels.attention.selector import get_attention_backend
from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.attention_cases import ON_GPU, needs_kernels
from tests.support.hf_reference import hf_model
from tests.support.window_schedule import (BACKENDS, TRITON, assert_chunks_and_decodes_match,
                                          assert_engine_greedy_with_prefix_hits)
from tests.support.paged_prefill import assert_tp2_matches_tp1, prefill_logits
from worker_service.models.gemma3 import Gemma3ForCausalLM
from worker_service.models.loader import load_model
from worker_service.models.tiny_model import make_tiny_model
from worker_service.parallel_state import single_rank_group

WINDOWS = [8, 0, 8]
ATOL = 1e-4


@pytest.fixture
def gemma(tiny_models):
    return lambda **overrides: tiny_models("gemma3", seed=4, **overrides)


def ours(path, backend: str = "torch", **kwargs):
    if backend == "cpu" and not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")
    return load_model(path, single_rank_group(), get_attention_backend(backend, "cpu"), "cpu",
                      **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_logits_match_transformers(gemma, backend):
    path = gemma()
    model = ours(path, backend)
    assert isinstance(model, Gemma3ForCausalLM) and model.lm_head_is_tied
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == WINDOWS
    assert all(layer.self_attn.attn.scale == 24 ** -0.5 for layer in layers)
    ids = torch.arange(41) * 37 % 500 + 3
    expected = hf_logits(hf_model(path), ids)
    torch.testing.assert_close(prefill_logits(model, ids), expected, atol=ATOL, rtol=0)
    # each layer type's own rope table matters: the sliding layers on the full table differ
    rotary = model.model.rotary
    for i in (0, 2):
        layers[i].self_attn.rotary_emb = rotary["full_attention"]
    assert (prefill_logits(model, ids) - expected).abs().max() > 1e-2
    for i in (0, 2):
        layers[i].self_attn.rotary_emb = rotary["sliding_attention"]
    # and so does the window
    for layer in layers:
        layer.self_attn.attn.sliding_window = 0
    assert (prefill_logits(model, ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_then_decodes_far_past_the_window(gemma, backend):
    """Blocks of 4: chunks of 11, 16 and 5 (windows start mid-block), then 24 decodes, with a
    second request batched alongside; every step's logits equal transformers'."""
    path = gemma()
    assert_chunks_and_decodes_match(ours(path, backend), hf_model(path), ATOL)


@pytest.mark.parametrize("backend,block_size", [("torch", 4), ("cpu", 4), ("cpu", 16),
                                                pytest.param("triton", 4, marks=TRITON)])
def test_engine_greedy_with_chunks_and_prefix_hits(gemma, backend, block_size):
    """Prompts up to 130 tokens, 16 tokens a step, a 70-token shared prefix: the greedy tokens
    equal transformers' generate() and the prefix cache was hit."""
    if backend == "cpu" and not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")
    assert_engine_greedy_with_prefix_hits(gemma(), backend, block_size, "gemma3")


@pytest.mark.slow
@needs_kernels
@pytest.mark.skipif(ON_GPU, reason="the model runs on the CPU: Triton interpreter only")
def test_fused_rope_per_layer_tables_writing_the_cache(gemma):
    """fused_ops with the Triton backend: each layer's rope launch takes its type's table and
    writes the KV cache (kv_in_rope); the backend still applies each layer's window."""
    from kernels.attention.triton_backend import TritonAttentionBackend
    path = gemma()
    model = load_model(path, single_rank_group(), TritonAttentionBackend(), "cpu", "float32",
                       fused_ops=True)
    assert all(layer.self_attn.kv_in_rope for layer in model.model.layers)
    ids = torch.arange(30) * 41 % 500 + 9
    torch.testing.assert_close(prefill_logits(model, ids), hf_logits(hf_model(path), ids),
                               atol=ATOL, rtol=0)


def test_final_logit_softcap_matches_transformers(gemma):
    """final_logit_softcapping=10: logits capped as transformers caps them."""
    path = gemma(final_logit_softcapping=10.0)
    model = ours(path)
    ids = torch.arange(20) * 11 % 500 + 3
    got = prefill_logits(model, ids)
    torch.testing.assert_close(got, hf_logits(hf_model(path), ids), atol=ATOL, rtol=0)
    assert got.abs().max() <= 10.0
    model.lm_head.softcap = None         # the cap mattered: uncapped, the logits go past it
    assert prefill_logits(model, ids).abs().max() > 12.0


def test_final_logit_softcap_logprobs_through_the_engine(gemma):
    """Greedy with logprobs through the engine: each token's logprob is transformers'
    log-softmax of the capped logits. A 9000-id vocabulary gives the CPU LM head its fused
    argmax path (uncapped logprobs), which a capped head turns off."""
    path = gemma(final_logit_softcapping=10.0, vocab_size=9000)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    head = llm.runner.model.lm_head
    if head.cpu_linear is None:
        pytest.skip("deltaserve_cpu not built")
    assert head.cpu_linear.fuses_greedy and head.greedy(torch.zeros(1, 64)) is None
    prompt = [5, 17, 33, 60, 2, 9, 41]
    out = llm.generate([prompt], [SamplingParams()], StoppingParams(max_tokens=6,
                                                                    ignore_eos=True),
                       num_logprobs=0)[0]
    full = torch.tensor(prompt + out.token_ids)
    expected = torch.log_softmax(hf_logits(hf_model(path), full), dim=-1)
    rows = expected[len(prompt) - 1:-1]
    assert out.token_ids == rows.argmax(dim=-1).tolist()
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    torch.testing.assert_close(got, rows.gather(1, full[len(prompt):, None])[:, 0],
                               atol=ATOL, rtol=0)


@pytest.mark.slow
def test_tp2_with_one_replicated_kv_head(tmp_path):
    """Two gloo ranks, num_key_value_heads=1 (as gemma-3-1b): the kv head is replicated, the 4
    query heads and the GeGLU split; both ranks' logits equal one rank's."""
    path = make_tiny_model(tmp_path / "g3", arch="gemma3", num_key_value_heads=1)
    assert_tp2_matches_tp1([path], tmp_path)
