"""The newer families served by the in-process engine from a KV cache too small for their
requests together, so they preempt each other, with chunked prefills (16 tokens a step) and a
shared 24-token prefix: greedy tokens equal transformers' generate(), the second request hits
the first's prefix, and no KV block leaks.

  - StarCoder2 with a window of 8 on every layer (blocks that left the window are freed);
  - SmolLM3 with YaRN x8 over 16 original positions and windows on its NoPE layers only (no
    block freed: the rope layers see every key), decoding past the original length;
  - Gemma (1).
"""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from tests.support.engine_checks import _check

BS = 4
CASES = {
    "starcoder2-window8": ("starcoder2", {"sliding_window": 8}, 12, 8),
    "smollm3-yarn-nope-windows": ("smollm3", {
        "max_position_embeddings": 16, "use_sliding_window": True, "sliding_window": 8,
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0,
                         "original_max_position_embeddings": 16}}, 20, 0),
    "gemma": ("gemma", {}, 20, 0),
}


def prompts(vocab: int) -> list[list[int]]:
    """Four prompts of 14-30 tokens, two sharing a 24-token prefix."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, vocab) for _ in range(24)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(6)],
            prefix + [rng.randrange(3, vocab) for _ in range(3)],
            [rng.randrange(3, vocab) for _ in range(14)],
            [rng.randrange(3, vocab) for _ in range(20)]]


@pytest.mark.parametrize("case", list(CASES))
def test_preempted_chunked_requests_match_transformers(tiny_models, case):
    arch, overrides, num_blocks, window = CASES[case]
    path = tiny_models(arch, seed=4, **overrides)
    llm = LLM(path, dtype="float32", attention_backend="torch", block_size=BS,
              num_kv_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=16)
    sched = llm.scheduler
    assert sched.kv.sliding_window == window
    preempted = []
    preempt = sched._preempt

    def counted(request, plan):
        preempted.append(request.request_id)
        preempt(request, plan)
    sched._preempt = counted
    outs = _check(llm, path, prompts(llm.model_info.vocab_size), case, max_new=30)
    assert preempted, "the four requests should not have fit together"
    assert outs[1].num_cached_tokens >= 24 // BS * BS, outs[1].num_cached_tokens
