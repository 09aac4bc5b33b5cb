"""Checks shared by the in-process engine tests: prompts, greedy comparison with transformers, and
that no KV block leaks."""
from __future__ import annotations
import random
from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy


MAX_NEW = 12


LENGTHS = [3, 17, 40, 64, 90, 5, 130, 33, 1, 51]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def _shared_prefix_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, vocab) for _ in range(70)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 20, 33)]
    prompts += _prompts(vocab, seed=2)[:4]
    prompts.append(list(prompts[1]))  # a repeated prompt: a full prefix hit
    prompts.append(list(prompts[6]))
    return prompts


def _check(llm: LLM, model_dir: str, prompts: list[list[int]], label: str,
           max_new: int = MAX_NEW) -> list:
    """Greedy outputs of `prompts` (max_new tokens each, eos ignored) equal transformers'
    generate(); no KV block left held. Returns the outputs."""
    outs = llm.generate(prompts, SamplingParams(),
                        StoppingParams(max_tokens=max_new, ignore_eos=True))
    near_ties, failures = [], []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        failure = compare_greedy(f"{label}/prompt{i}(len {len(p)})", out.token_ids,
                                 hf_greedy(model_dir, tuple(p), max_new), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
    assert_no_leaked_blocks(llm)
    return outs


def check_greedy_and_prefix_hits(model_dir: str, label: str,
                                 reference_dir: str | None = None) -> None:
    """The in-process engine's greedy tokens equal generate()'s (on `reference_dir` when
    transformers cannot run `model_dir` itself); then the same prompts again: whole-block
    prefix-cache hits, and the same tokens."""
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    reference = reference_dir or model_dir
    _check(llm, reference, _prompts(llm.model_info.vocab_size), f"{label}/plain")
    _check(llm, reference, _prompts(llm.model_info.vocab_size), f"{label}/prefix-hits")
    assert llm.scheduler.kv.stats.hits > 0


def check_chunked_greedy(model_dir: str, label: str) -> None:
    """24 tokens a step, most prompts longer: chunked prefills batched with decodes give
    generate()'s greedy tokens."""
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=24,
              max_num_seqs=8)
    _check(llm, model_dir, _prompts(llm.model_info.vocab_size), f"{label}/chunked")


MODELS = ["qwen3", "llama"]


def assert_no_leaked_blocks(llm) -> None:
    """Every KV block is back in the pool once nothing is running."""
    sched = llm.scheduler
    assert not sched.has_unfinished_requests()
    assert sched.num_free_blocks == sched.num_total_blocks, (
        f"{sched.num_total_blocks - sched.num_free_blocks} KV blocks leaked")
    window = getattr(sched.kv, "window_group", None)     # a hybrid model's (hybrid_kv.py)
    if window is not None:
        assert window.num_free_blocks == window.num_total_blocks, (
            f"{window.num_total_blocks - window.num_free_blocks} window-group blocks leaked")
