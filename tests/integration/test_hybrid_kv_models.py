"""Hybrid KV cache (engine_common/request/kv_groups.py) on the tiny Gemma 2 (layers window 8 /
full alternating) and GPT-OSS (window 8 / full / window 8) models through the in-process
engine, against transformers' greedy tokens (fp32), on the torch and the C++ CPU backends and
Triton under its interpreter.

Blocks of 4 tokens, 2 sequences, 16 tokens a step: the window group's pool is
window_pool_bound = 2 * (2 + 3) + 2 * 4 = 18 blocks. A budget of 40 blocks of every layer holds
160 tokens as one pool; split, the full group gets 62 (Gemma 2) or 84 (GPT-OSS) blocks, so a
request of 180 tokens runs whole, two of them preempt each other, and a prefix hit right after
its first request holds in both groups.
"""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from kernels.attention import cpu_paged
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy
from tests.support.window_schedule import BACKENDS

ARCHS = {"gemma2": 62, "gpt_oss": 84}          # full-group blocks of the 40-block budget
BUDGET, WINDOW_POOL = 40, 18


def _llm(path: str, backend: str) -> LLM:
    if backend == "cpu" and not cpu_paged.available():
        pytest.skip("deltaserve_cpu not built")
    return LLM(path, dtype="float32", attention_backend=backend, block_size=4,
               num_kv_blocks=BUDGET, max_num_seqs=2, max_num_batched_tokens=16)


def _greedy(llm: LLM, path: str, prompts: list[list[int]], max_new: int, label: str) -> list:
    outs = llm.generate(prompts, SamplingParams(),
                        StoppingParams(max_tokens=max_new, ignore_eos=True))
    near_ties, failures = [], []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        failure = compare_greedy(f"{label}/prompt{i}(len {len(p)})", out.token_ids,
                                 hf_greedy(path, tuple(p), max_new), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
    assert_no_leaked_blocks(llm)          # both groups' pools whole
    return outs


def _spy_preemptions(llm: LLM) -> list[int]:
    """The handles each diff preempts, from now on."""
    preempted, schedule = [], llm.scheduler.schedule

    def spy():
        out = schedule()
        preempted.extend(out.preempted_handles)
        return out
    llm.scheduler.schedule = spy
    return preempted


def _prompt(n: int, seed: int) -> list[int]:
    return [(i * 37 + seed * 101) % 480 + 5 for i in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)       # torch, cpu, Triton (interpreted: slow)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_longer_than_one_pool_holds_preempts_and_hits(tiny_models, arch, backend):
    path = tiny_models(arch)
    llm = _llm(path, backend)
    kv = llm.scheduler.kv
    assert (kv.num_total_blocks, kv.window_group.num_total_blocks) == (ARCHS[arch], WINDOW_POOL)
    assert llm.scheduler.max_len == ARCHS[arch] * 4 > BUDGET * 4    # one pool: 160 tokens
    label = f"{arch}/{backend}"
    # 150 + 30 tokens: more than one pool of the same bytes holds, whole here
    long = _greedy(llm, path, [_prompt(150, 1)], 30, f"{label}/long")
    assert len(long[0].token_ids) == 30
    # two such requests do not fit the full group together: one is preempted, resumes
    preempted = _spy_preemptions(llm)
    _greedy(llm, path, [_prompt(150, 2), _prompt(150, 3)], 30, f"{label}/preempt")
    assert preempted
    # the same prompt again at once: a hit both groups hold
    shared = _prompt(60, 4)
    _greedy(llm, path, [shared], 4, f"{label}/first")
    outs = _greedy(llm, path, [shared + [7, 9, 11]], 4, f"{label}/hit")
    assert outs[0].num_cached_tokens >= 52, outs[0].num_cached_tokens


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_prompt_repeated_after_a_longer_one_still_hits(tiny_models, arch):
    """A 150-token request between a 60-token prompt and its repeat passes ~40 blocks through
    the 18-block window pool; the blocks it leaves behind its window are churn, evicted before
    the first prompt's tail, so the repeat hits in both groups (one pool of the same bytes
    would keep it too) and its tokens are transformers'."""
    path = tiny_models(arch)
    llm = _llm(path, "torch")
    shared = _prompt(60, 5)
    _greedy(llm, path, [shared], 4, f"{arch}/first")
    _greedy(llm, path, [_prompt(150, 6)], 4, f"{arch}/between")
    outs = _greedy(llm, path, [shared + [7, 9, 11]], 4, f"{arch}/repeat")
    assert outs[0].num_cached_tokens >= 52, outs[0].num_cached_tokens


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_ngram_drafts_with_both_groups_match_transformers(tiny_models, arch, asynchronous):
    """n-gram drafts (lookahead slots in both groups, rollbacks below freed window blocks; with
    async scheduling a step in flight while the next frees): repetitive prompts of 120 to 200
    tokens, far past the window of 8; greedy tokens are transformers', both pools whole."""
    path = tiny_models(arch)
    llm = LLM(path, dtype="float32", attention_backend="torch", block_size=4,
              num_kv_blocks=BUDGET, max_num_seqs=2, max_num_batched_tokens=16,
              async_scheduling=asynchronous,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert llm.scheduler.kv.window_group.num_total_blocks == WINDOW_POOL
    prompts = [[5, 17, 99, 42, 7] * 24, [3, 4, 5, 6] * 30, _prompt(100, 8) * 2]
    _greedy(llm, path, prompts, 24, f"{arch}/spec/{asynchronous}")
    stats = llm.scheduler.spec.stats
    assert stats.num_draft_tokens + stats.num_dropped > 0, stats


@pytest.mark.parametrize("arch", list(ARCHS))
def test_copies_of_one_prompt_in_one_batch_share_blocks_in_both_groups(tiny_models, arch):
    """Three copies of a 70-token prompt at once (as n > 1 fans out): the later ones hit the
    blocks the first caches as it is scheduled, in both groups, while it still computes past
    them; the window group frees a shared block only with its last holder. Greedy tokens are
    transformers' for each, both pools whole."""
    path = tiny_models(arch)
    llm = _llm(path, "torch")
    prompt = _prompt(70, 9)
    outs = _greedy(llm, path, [prompt] * 3, 20, f"{arch}/copies")
    assert max(o.num_cached_tokens for o in outs) >= 64, [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_async_scheduling_preempts_and_hits_in_both_groups(tiny_models, arch):
    """Async scheduling (a step in flight while the next one frees window blocks and preempts):
    two requests of 150 + 30 tokens that do not fit the full group together, then a prompt and
    its repeat; greedy tokens are transformers', a preemption happened, the repeat hits in
    both groups, both pools whole."""
    path = tiny_models(arch)
    llm = LLM(path, dtype="float32", attention_backend="torch", block_size=4,
              num_kv_blocks=BUDGET, max_num_seqs=2, max_num_batched_tokens=16,
              async_scheduling=True)
    preempted = _spy_preemptions(llm)
    _greedy(llm, path, [_prompt(150, 10), _prompt(150, 11)], 30, f"{arch}/async")
    assert preempted
    shared = _prompt(60, 12)
    _greedy(llm, path, [shared], 4, f"{arch}/async-first")
    outs = _greedy(llm, path, [shared + [3, 5]], 4, f"{arch}/async-hit")
    assert outs[0].num_cached_tokens >= 52, outs[0].num_cached_tokens
