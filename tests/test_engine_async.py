"""The in-process engine with async scheduling (two steps in flight, the runner on its own
thread) against transformers' greedy tokens, and against the synchronous engine on a sampled
workload with stop strings, min_tokens and logprobs."""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from engine_common.params import SamplingParams, StoppingParams
from tests.conftest import assert_no_leaked_blocks
from tests.test_engine_vs_transformers import MODELS, _check, _prompts, _shared_prefix_prompts


def _watch_pipeline(llm: LLM) -> dict:
    """Record the deepest pipeline and every preemption the engine sees."""
    seen = {"depth": 0, "preempted": 0}
    core, orig_step, orig_schedule = llm.engine, llm.engine.step, llm.scheduler.schedule

    def step():
        out = orig_step()
        seen["depth"] = max(seen["depth"], len(core._in_flight) + (1 if out else 0))
        return out

    def schedule():
        out = orig_schedule()
        seen["preempted"] += len(out.preempted_handles)
        return out
    core.step, llm.scheduler.schedule = step, schedule
    return seen


@pytest.mark.parametrize("arch", MODELS)
def test_async_chunked_prefill_and_preemption_match_transformers(tiny_models, arch):
    model = tiny_models(arch)
    llm = LLM(model, dtype="float32", num_kv_blocks=10, enable_prefix_caching=False,
              max_num_batched_tokens=24, max_num_seqs=8, async_scheduling=True)
    seen = _watch_pipeline(llm)
    _check(llm, model, _prompts(llm.model_info.vocab_size), f"{arch}/async-preempt")
    assert seen["depth"] == 2 and seen["preempted"] > 0, seen


def test_async_prefix_cache_hits_match_transformers(tiny_models):
    model = tiny_models("qwen3")
    llm = LLM(model, dtype="float32", num_kv_blocks=256, max_num_seqs=4, async_scheduling=True)
    outs = _check(llm, model, _shared_prefix_prompts(llm.model_info.vocab_size), "async-prefix")
    assert outs[-2].num_cached_tokens > 0 and outs[-1].num_cached_tokens > 0


def test_async_equals_sync_on_a_sampled_workload(tiny_models):
    model = tiny_models("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 40))] for _ in range(16)]
    samplings = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=i,
                                repetition_penalty=1.1) if i % 2 else SamplingParams(seed=i)
                 for i in range(16)]
    stoppings = [StoppingParams(max_tokens=rng.randrange(1, 20), min_tokens=i % 3,
                                stop=("e",) if i % 4 == 0 else (),
                                ignore_eos=i % 5 == 0) for i in range(16)]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model, dtype="float32", num_kv_blocks=24, max_num_seqs=6,
                  max_num_batched_tokens=32, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, samplings, stoppings, num_logprobs=2)
        results.append(outs)
        assert_no_leaked_blocks(llm)
    # Other batch shapes round differently: logprobs agree to float32 noise, the rest exactly.
    for sync, asyn in zip(*results):
        assert ((sync.token_ids, sync.text, sync.finish_reason, sync.stop_reason)
                == (asyn.token_ids, asyn.text, asyn.finish_reason, asyn.stop_reason))
        assert [lp.top_token_ids for lp in sync.logprobs] == [
            lp.top_token_ids for lp in asyn.logprobs]
        assert [lp.logprob for lp in sync.logprobs] == pytest.approx(
            [lp.logprob for lp in asyn.logprobs], abs=1e-4)
    assert sum(len(o.token_ids) for o in results[0]) > 60
