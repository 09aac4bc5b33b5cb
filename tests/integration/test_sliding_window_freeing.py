"""A tiny Mistral whose every layer has a window of 8, served by the in-process engine from a KV
cache too small for its requests unless the blocks that left the window are freed
(scheduler_service/core/sliding_window.py): greedy tokens equal transformers' on the torch and
CPU backends, through preemption and prefix-cache hits, and no block leaks."""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from kernels.attention import cpu_paged
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy

WINDOW, BS, NUM_BLOCKS, MAX_NEW = 8, 4, 12, 40


def prompts(vocab: int) -> list[list[int]]:
    """Four prompts of 14-30 tokens, two sharing a 24-token prefix."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, vocab) for _ in range(24)]
    out = [prefix + [rng.randrange(3, vocab) for _ in range(6)],
           prefix + [rng.randrange(3, vocab) for _ in range(3)],
           [rng.randrange(3, vocab) for _ in range(14)],
           [rng.randrange(3, vocab) for _ in range(20)]]
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_requests_longer_than_the_cache_match_transformers(tiny_models, backend):
    """12 blocks of 4 tokens hold 48 tokens; each request reaches 54-70 (without freeing it
    would stop at 48), four run at once (they preempt each other), the second hits the first's
    prefix: greedy tokens equal transformers' generate()."""
    if backend == "cpu" and not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")
    path = tiny_models("mistral", seed=4, sliding_window=WINDOW)
    llm = LLM(path, dtype="float32", attention_backend=backend, block_size=BS,
              num_kv_blocks=NUM_BLOCKS, max_num_seqs=4, max_num_batched_tokens=16)
    sched = llm.scheduler
    assert sched.kv.sliding_window == WINDOW and sched.max_len > NUM_BLOCKS * BS
    preempted = []
    preempt = sched._preempt

    def counted(request, plan):
        preempted.append(request.request_id)
        preempt(request, plan)
    sched._preempt = counted
    batch = prompts(llm.model_info.vocab_size)
    outs = llm.generate(batch, SamplingParams(),
                        StoppingParams(max_tokens=MAX_NEW, ignore_eos=True))
    near_ties, failures = [], []
    for i, (p, out) in enumerate(zip(batch, outs)):
        assert len(out.token_ids) == MAX_NEW
        failure = compare_greedy(f"{backend}/prompt{i}(len {len(p)})", out.token_ids,
                                 hf_greedy(path, tuple(p), MAX_NEW), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
    assert preempted, "the four requests should not have fit together"
    assert outs[1].num_cached_tokens >= 24 // BS * BS, outs[1].num_cached_tokens
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_drafts_rolled_back_below_a_freed_block_match_transformers(tiny_models, asynchronous):
    """n-gram drafts on the windowed model. With async scheduling a step is scheduled while
    the step before is in flight, its drafts counted as computed: blocks must be freed from
    where the rejected drafts could take the request back to, not from the optimistic count
    (freed there, a rejection left queries whose window reaches a block another request now
    holds; tests/unit/.../test_spec_decode_async.py pins that with a simulated worker).
    Greedy tokens equal transformers', no block leaks."""
    path = tiny_models("mistral", seed=4, sliding_window=WINDOW)
    llm = LLM(path, dtype="float32", attention_backend="torch", block_size=BS,
              num_kv_blocks=NUM_BLOCKS + 4, max_num_seqs=4, max_num_batched_tokens=24,
              async_scheduling=asynchronous,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    rng = random.Random(11)
    vocab = llm.model_info.vocab_size
    batch = [[5, 17, 99, 42, 7] * 4, [200] * 9, [3, 4, 5, 6] * 5,
             [rng.randrange(3, vocab) for _ in range(12)] * 2]
    outs = llm.generate(batch, SamplingParams(),
                        StoppingParams(max_tokens=MAX_NEW, ignore_eos=True))
    near_ties, failures = [], []
    for i, (p, out) in enumerate(zip(batch, outs)):
        failure = compare_greedy(f"spec/{asynchronous}/prompt{i}", out.token_ids,
                                 hf_greedy(path, tuple(p), MAX_NEW), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
    stats = llm.scheduler.spec.stats     # (the tiny model seldom repeats: drafts rejected)
    assert stats.num_draft_tokens + stats.num_dropped > 0, stats
    assert_no_leaked_blocks(llm)
