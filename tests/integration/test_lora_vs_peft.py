"""LoRA adapters (docs/lora.md): the in-process LLM's greedy tokens equal transformers + peft's,
fp32, for the base model, one adapter, and mixed batches of base and two adapters in the same
steps (chunked prefill, prefix-cache hits within an adapter and none across adapters)."""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import ParamError
from tests.support.lora_adapters import check_lora_greedy, make_adapter, peft_greedy

MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tiny_models, tmp_path_factory):
    model = tiny_models(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    sql = make_adapter(model, root / "sql", r=8, alpha=32, seed=1)
    chat = make_adapter(model, root / "chat", r=4, alpha=8, seed=2, use_rslora=True,
                        targets=("q_proj", "v_proj", "down_proj"))
    return model, {"sql": sql, "chat": chat}


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def _check(llm: LLM, model: str, adapters: dict, prompts, names) -> list:
    return check_lora_greedy(llm, prompts, names, MAX_NEW,
                             lambda name, p: peft_greedy(model, adapters.get(name), p, MAX_NEW))


def _llm(model: str, adapters: dict, **kw) -> LLM:
    mods = " ".join(f"{n}={p}" for n, p in adapters.items())
    return LLM(model, dtype="float32", num_kv_blocks=256, enable_lora=True, lora_modules=mods,
               **kw)


def test_adapters_change_the_tokens(setup):
    """The references differ: an adapter that changed nothing would prove nothing."""
    model, adapters = setup
    p = tuple(_prompts(200, 1, 7)[0])
    outs = {n: peft_greedy(model, adapters.get(n), p, MAX_NEW).token_ids
            for n in (None, "sql", "chat")}
    assert len(set(outs.values())) == 3, outs


def test_mixed_batch_matches_peft(setup):
    model, adapters = setup
    llm = _llm(model, adapters, max_loras=2)
    prompts = _prompts(llm.model_info.vocab_size, 9, 0)
    names = [None, "sql", "chat"] * 3
    _check(llm, model, adapters, prompts, names)


def test_one_adapter_chunked_prefill(setup):
    model, adapters = setup
    llm = _llm(model, adapters, max_num_batched_tokens=24, max_num_seqs=8)
    prompts = _prompts(llm.model_info.vocab_size, 4, 3)
    _check(llm, model, adapters, prompts, ["sql"] * 4)


def test_prefix_cache_shared_within_an_adapter_only(setup):
    model, adapters = setup
    llm = _llm(model, adapters, max_loras=2)
    prompt = _prompts(llm.model_info.vocab_size, 1, 5)[0] * 2       # > 2 blocks
    first = _check(llm, model, adapters, [prompt], ["sql"])
    assert first[0].num_cached_tokens == 0
    again = _check(llm, model, adapters, [prompt, prompt, prompt], ["sql", "chat", None])
    assert again[0].num_cached_tokens > 0          # same adapter: its blocks
    assert again[1].num_cached_tokens == 0         # another adapter: none of them
    assert again[2].num_cached_tokens == 0         # the base model: none either


def test_max_loras_one_runs_both_adapters(setup):
    model, adapters = setup
    llm = _llm(model, adapters, max_loras=1)
    seen = []
    orig_schedule = llm.scheduler.schedule

    def schedule():
        out = orig_schedule()
        seen.append({r.lora_id for r in llm.scheduler.running if r.lora_id})
        return out

    llm.scheduler.schedule = schedule
    prompts = _prompts(llm.model_info.vocab_size, 6, 9)
    _check(llm, model, adapters, prompts, ["sql", "chat", None] * 2)
    assert max(map(len, seen)) == 1, seen        # one adapter at a time...
    assert {1, 2} <= set().union(*seen)         # ...and both ran


def test_unknown_adapter_is_refused(setup):
    model, adapters = setup
    llm = _llm(model, adapters)
    with pytest.raises(ParamError, match=r"lora_request='nope'.*\['chat', 'sql'\]"):
        llm.generate([[5, 6, 7]], lora_request="nope")
