"""LoRA on routed MoE experts through the engine's harder steps (docs/lora.md, "MoE experts"):
greedy tokens, fp32, equal transformers' with each adapter merged into the weights under
chunked prefill with preemption, async scheduling, and prefix-cache hits within an adapter only.
Adapter "experts" touches nothing but routed experts (per-expert form, no attention), so a block
cached under it differs from the base model's only through the MoE layers' outputs feeding
later layers: a hit across adapters would show in the tokens."""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from tests.support.lora_adapters import check_lora_greedy, make_adapter
from tests.support.moe_lora import per_expert_adapter, reference

MAX_NEW = 10


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    model = tiny_models("qwen3_moe")
    root = tmp_path_factory.mktemp("moe-steps")
    experts = per_expert_adapter(model, root / "experts", experts={0: list(range(8))},
                                 r=8, alpha=16, seed=7, attention=False)
    fused = make_adapter(model, root / "fused", r=4, alpha=16, seed=8,
                         targets=("gate_proj", "up_proj", "down_proj"))
    return model, {"experts": experts, "fused": fused}


def _prompts(vocab: int, n: int, seed: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _check(llm: LLM, model: str, adapters: dict, prompts, names) -> list:
    return check_lora_greedy(llm, prompts, names, MAX_NEW, lambda name, p: reference(
        model, adapters.get(name), p, MAX_NEW)[0])


def _llm(model: str, adapters: dict, **kw) -> LLM:
    mods = " ".join(f"{n}={p}" for n, p in adapters.items())
    return LLM(model, dtype="float32", enable_lora=True, lora_modules=mods, max_loras=2, **kw)


def test_expert_only_adapter_changes_the_tokens(setup):
    model, adapters = setup
    p = tuple(_prompts(200, 1, 3)[0])
    outs = {n: reference(model, adapters.get(n), p, MAX_NEW)[0].token_ids
            for n in (None, "experts", "fused")}
    assert len(set(outs.values())) == 3, outs


def test_preempted_chunked_mixed_batch(setup):
    model, adapters = setup
    llm = _llm(model, adapters, num_kv_blocks=12, block_size=4, max_num_seqs=4,
               max_num_batched_tokens=10)
    sched, preempted = llm.scheduler, []
    preempt = sched._preempt

    def counted(request, plan):
        preempted.append(request.request_id)
        preempt(request, plan)
    sched._preempt = counted
    prompts = _prompts(llm.model_info.vocab_size, 4, 11, lo=14, hi=20)
    _check(llm, model, adapters, prompts, ["experts", None, "fused", "experts"])
    assert preempted, "the four requests should not have fit together"


def test_async_scheduling_mixed_batch(setup):
    model, adapters = setup
    llm = _llm(model, adapters, num_kv_blocks=256, async_scheduling=True,
               max_num_batched_tokens=24, max_num_seqs=8)
    prompts = _prompts(llm.model_info.vocab_size, 6, 12)
    _check(llm, model, adapters, prompts, ["experts", None, "fused"] * 2)


def test_prefix_cache_shared_within_an_expert_adapter_only(setup):
    model, adapters = setup
    llm = _llm(model, adapters, num_kv_blocks=256, block_size=4)
    prompt = _prompts(llm.model_info.vocab_size, 1, 13, lo=20, hi=21)[0]
    first = _check(llm, model, adapters, [prompt], ["experts"])
    assert first[0].num_cached_tokens == 0
    again = _check(llm, model, adapters, [prompt] * 3, ["experts", "fused", None])
    assert again[0].num_cached_tokens > 0          # same adapter: its blocks
    assert again[1].num_cached_tokens == 0         # another adapter: none of them
    assert again[2].num_cached_tokens == 0         # the base model: none either
    base = _check(llm, model, adapters, [prompt], [None])
    assert base[0].num_cached_tokens > 0           # the base model's own blocks now
