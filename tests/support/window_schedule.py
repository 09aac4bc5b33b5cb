"""Chunked prefill then decodes far past a sliding window, step by step against transformers,
and the engine's greedy tokens with prefix hits: what the windowed-model tests (Mistral / Qwen2
windows, Gemma 3) share."""
from __future__ import annotations

import pytest
import torch

from deltaserve.llm import LLM
from tests.integration.test_model_vs_transformers import PagedRunner, hf_logits
from tests.support.attention_cases import ON_GPU, needs_kernels
from tests.support.engine_checks import MAX_NEW, _check, _shared_prefix_prompts

# Blocks of 4: chunks of 11, 16 and 5 (windows start mid-block), then 24 decodes, a second
# request batched alongside for 20 of them.
# The windowed models' backends on the CPU: Triton runs under its interpreter only, and slowly.
TRITON = [pytest.mark.slow, needs_kernels,
          pytest.mark.skipif(ON_GPU, reason="the models run on the CPU: Triton interpreter only")]
BACKENDS = ["torch", "cpu", pytest.param("triton", marks=TRITON)]
SCHEDULE = [[11, 16], [16, 0], [5, 4]] + [[1, 1]] * 20 + [[1, 0]] * 4


def assert_chunks_and_decodes_match(model, reference, atol: float) -> None:
    """Every step's logits of two requests (56 and 40 tokens) equal transformers'."""
    seqs = [torch.arange(56) * 13 % 500 + 5, torch.arange(40) * 29 % 500 + 7]
    expected = [hf_logits(reference, s) for s in seqs]
    runner = PagedRunner(model, seqs, seed=3)
    for num_new in SCHEDULE:
        before = list(runner.done)
        outs = runner.step(num_new)
        for i, n in enumerate(num_new):
            torch.testing.assert_close(outs[i], expected[i][before[i]:before[i] + n],
                                       atol=atol, rtol=0)
    assert runner.done == [56, 40]


def assert_engine_greedy_with_prefix_hits(path: str, backend: str, block_size: int,
                                          label: str) -> None:
    """Prompts up to 130 tokens, 16 tokens a step, a 70-token shared prefix: the engine's greedy
    tokens equal transformers' generate() and the prefix cache was hit."""
    llm = LLM(path, dtype="float32", attention_backend=backend, block_size=block_size,
              num_kv_blocks=512, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = _shared_prefix_prompts(llm.model_info.vocab_size)
    if backend == "triton":          # the interpreter: fewer requests (prompts[-2] repeats 1)
        prompts = prompts[:2] + prompts[-2:-1]
    first = _check(llm, path, prompts[:1], f"{label}/{backend}/first")
    rest = _check(llm, path, prompts[1:], f"{label}/{backend}/prefix")
    cached = [o.num_cached_tokens for o in first + rest]
    assert cached[0] == 0
    assert cached[1] >= 70 // block_size * block_size, cached      # the shared prefix
    if getattr(llm.scheduler.kv, "window_group", None) is None:
        assert cached[-1] > 0, cached                               # a repeated prompt
    else:
        # A hybrid cache's window group keeps few freed blocks (kv_groups.window_pool_bound):
        # a prompt repeated after eight others finds its last window evicted there, so the
        # hit is cut to nothing; repeated right after its own run, it hits in both groups.
        again = _check(llm, path, [prompts[-1]], f"{label}/{backend}/again")
        assert again[0].num_cached_tokens > 0, again[0].num_cached_tokens
    assert all(len(o.token_ids) == MAX_NEW for o in first + rest)
