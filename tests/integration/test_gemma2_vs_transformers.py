"""Gemma 2 (Gemma2ForCausalLM) against transformers on the same tiny random weights (float32,
CPU). The tiny model (models/tiny_model.py "gemma2"): 4 layers, sliding (window 8) / full
alternating as Gemma2Config decides; attention scale 24 ** -0.5 with head_dim 16; attention
logit softcap 2 and final logit softcap 5, low enough that the tiny model's scores reach them;
tied embeddings.

On the torch backend, the CPU backend (its kernel hands the capped layers to torch) and Triton
under the interpreter: prefill logits of a prompt five windows long, and that each cap, the
window and the scale matter; chunked prefill then decodes far past the window (logits at every
step); greedy tokens through the in-process engine with chunked prefill and prefix-cache hits;
a sampled run's logprobs and prompt logprobs against transformers' log_softmax of the capped
logits.
"""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from kernels.attention import cpu_paged
from kernels.attention.selector import get_attention_backend
from tests.integration.test_model_vs_transformers import hf_logits
from tests.support.hf_reference import hf_model
from tests.support.paged_prefill import prefill_logits
from tests.support.window_schedule import (BACKENDS, TRITON, assert_chunks_and_decodes_match,
                                          assert_engine_greedy_with_prefix_hits)
from worker_service.models.gemma2 import Gemma2ForCausalLM
from worker_service.models.loader import load_model
from worker_service.parallel_state import single_rank_group

WINDOWS = [8, 0, 8, 0]
ATOL = 1e-4


@pytest.fixture
def gemma(tiny_models):
    return lambda **overrides: tiny_models("gemma2", seed=4, **overrides)


def ours(path, backend: str = "torch"):
    if backend == "cpu" and not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")
    return load_model(path, single_rank_group(), get_attention_backend(backend, "cpu"), "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_logits_match_transformers(gemma, backend):
    path = gemma()
    model = ours(path, backend)
    assert isinstance(model, Gemma2ForCausalLM) and model.lm_head_is_tied
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == WINDOWS
    assert all(a.scale == 24 ** -0.5 and a.softcap == 2.0 for a in attns)
    assert model.lm_head.softcap == 5.0
    ids = torch.arange(41) * 37 % 500 + 3
    expected = hf_logits(hf_model(path), ids)
    got = prefill_logits(model, ids)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert got.abs().max() <= 5.0
    # each of the attention cap, the window and the final cap matters on these weights
    for a in attns:
        a.softcap = 0.0
    assert (prefill_logits(model, ids) - expected).abs().max() > 1e-2
    for a in attns:
        a.softcap, a.sliding_window = 2.0, 0
    assert (prefill_logits(model, ids) - expected).abs().max() > 1e-2
    for a, window in zip(attns, WINDOWS):
        a.sliding_window = window
    model.lm_head.softcap = None
    assert prefill_logits(model, ids).abs().max() > 6.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_then_decodes_far_past_the_window(gemma, backend):
    """Blocks of 4: chunks of 11, 16 and 5 (windows start mid-block), then 24 decodes, with a
    second request batched alongside; every step's logits equal transformers'."""
    path = gemma()
    assert_chunks_and_decodes_match(ours(path, backend), hf_model(path), ATOL)


@pytest.mark.parametrize("backend,block_size", [("torch", 4), ("cpu", 16),
                                                pytest.param("triton", 4, marks=TRITON)])
def test_engine_greedy_with_chunks_and_prefix_hits(gemma, backend, block_size):
    """Prompts up to 130 tokens, 16 tokens a step, a 70-token shared prefix: the greedy tokens
    equal transformers' generate() and the prefix cache was hit."""
    if backend == "cpu" and not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")
    assert_engine_greedy_with_prefix_hits(gemma(), backend, block_size, "gemma2")


def test_sampled_logprobs_and_prompt_logprobs_are_the_capped_ones(gemma):
    """A sampled run (temperature 1, seeded) with logprobs and prompt logprobs: every logprob is
    transformers' log_softmax of the capped logits at that position (fp32 tolerance)."""
    path = gemma()
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    prompt = [5, 17, 33, 60, 2, 9, 41, 77, 13, 8, 250, 31]
    out = llm.generate([prompt], [SamplingParams(temperature=1.0, seed=7)],
                       StoppingParams(max_tokens=8, ignore_eos=True), num_logprobs=0,
                       num_prompt_logprobs=0)[0]
    full = torch.tensor(prompt + out.token_ids)
    expected = torch.log_softmax(hf_logits(hf_model(path), full), dim=-1)
    chosen = expected[:-1].gather(1, full[1:, None])[:, 0]        # logprob of each next token
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    torch.testing.assert_close(got, chosen[len(prompt) - 1:], atol=ATOL, rtol=0)
    prompt_got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(prompt_got, chosen[:len(prompt) - 1], atol=ATOL, rtol=0)
    assert len(set(out.token_ids)) > 1            # sampled, not a repeated argmax


def test_a_backend_without_softcap_is_refused_naming_model_and_backend(gemma):
    """Never attend uncapped: a backend without supports_softcap fails the load by name."""
    from kernels.attention.torch_ref import TorchAttentionBackend

    class NoCap(TorchAttentionBackend):
        name = "nocap"
        supports_softcap = False

    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM \(attn_logit_softcapping=2.0\): "
                                         r"the 'nocap' attention backend cannot apply"):
        load_model(gemma(), single_rank_group(), NoCap(), "cpu")
