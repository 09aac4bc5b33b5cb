"""Chunked prefill then decodes far past a sliding window, step by step against transformers:
what the windowed-model tests (Mistral / Qwen2 windows, Gemma 3) share."""
from __future__ import annotations

import torch

from tests.integration.test_model_vs_transformers import PagedRunner, hf_logits

# Blocks of 4: chunks of 11, 16 and 5 (windows start mid-block), then 24 decodes, a second
# request batched alongside for 20 of them.
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
