"""The in-process engine with async scheduling (two steps in flight, the runner on its own
thread) against transformers' greedy tokens, and against the synchronous engine on a sampled
workload with stop strings, min_tokens and logprobs, with aborts while a step is in flight, with
prefix caching under preemption, and at the max_model_len and max_tokens=1 edges.

Every test runs twice: as the CPU runs it (the runner finishes step t before it launches t+1)
and pipelined, as CUDA runs it (step t+1 launched before step t is finished, its input ids fed
from step t's sampler output: deltaserve.llm_executor.RunnerPipeline, sample/token_readback.TokenFeed).
"""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM, Completion
from engine_common.wire.codec import encode_scheduler_output
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.engine_checks import MODELS, _check, _prompts, _shared_prefix_prompts
from tests.support.pipelining import pipelined  # noqa: F401 (autouse fixture)


def _watch_pipeline(llm: LLM) -> dict:
    """Record the deepest pipeline and every preemption the engine sees."""
    seen = {"depth": 0, "preempted": 0}
    engine, orig_step, orig_schedule = llm.engine, llm.engine.step, llm.scheduler.schedule
    core = engine.core

    def step():
        out = orig_step()
        seen["depth"] = max(seen["depth"], len(core._in_flight))
        return out

    def schedule():
        out = orig_schedule()
        seen["preempted"] += len(out.preempted_handles)
        return out
    engine.step, llm.scheduler.schedule = step, schedule
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


def _workload(seed: int, n: int):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(9)]     # two full blocks of 4 tokens
    prompts = [shared * (i % 2) + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))]
               for i in range(n)]
    samplings = [SamplingParams(temperature=0.8, seed=i) if i % 2 else SamplingParams(seed=i)
                 for i in range(n)]
    stoppings = [StoppingParams(max_tokens=rng.randrange(1, 14), min_tokens=i % 2,
                                stop=("e",) if i % 3 == 0 else (), ignore_eos=i % 4 == 0)
                 for i in range(n)]
    return prompts, samplings, stoppings


def test_async_aborts_in_flight_leave_nothing_behind(tiny_models):
    """Aborts between steps (a step still in flight on the runner thread, writing into blocks the
    abort frees, some of them cached prefix blocks others hit): every other request ends exactly
    as in a synchronous run without aborts (tokens, text, usage), an aborted one with a prefix of
    those tokens; no block leaks and the runner drops every request."""
    model = tiny_models("qwen3")
    prompts, samplings, stoppings = _workload(3, 12)
    kw = dict(dtype="float32", num_kv_blocks=30, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=32)
    want = LLM(model, **kw).generate(prompts, samplings, stoppings)
    llm = LLM(model, async_scheduling=True, **kw)
    engine, rng = llm.engine, random.Random(4)
    got = {f"a{i}": Completion(f"a{i}", p) for i, p in enumerate(prompts)}
    for i, (p, sp, st) in enumerate(zip(prompts, samplings, stoppings)):
        engine.add_request(Request(f"a{i}", p, sp, st, llm.model_info.eos_token_ids))
    aborted, usage = set(), {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        live = sorted(engine.scheduler._requests)
        if engine.core._in_flight and live and rng.random() < 0.2:
            aborted.add(rid := rng.choice(live))
            outs += engine.abort([rid])
        for out in outs:
            LLM._merge(got[out.request_id], out)
            usage[out.request_id] = out.num_output_tokens
    assert_no_leaked_blocks(llm)
    assert llm.scheduler.prefix_cache_hit_rate > 0
    llm.engine.core.executor.execute(encode_scheduler_output(llm.scheduler.schedule()))
    assert llm.runner.requests == {} and llm.runner.batch.num_reqs == 0
    assert 2 <= len(aborted) <= 10, aborted
    assert any(w.finish_reason == RequestStatus.FINISHED_STOP_STRING
               and f"a{i}" not in aborted for i, w in enumerate(want))
    for i, w in enumerate(want):
        g = got[f"a{i}"]
        assert usage[g.request_id] == len(g.token_ids)
        if g.request_id in aborted:
            assert g.finish_reason == RequestStatus.FINISHED_ABORTED
            assert g.token_ids == w.token_ids[:len(g.token_ids)], g.request_id
        else:
            assert ((g.token_ids, g.text, g.finish_reason, g.stop_reason)
                    == (w.token_ids, w.text, w.finish_reason, w.stop_reason)), g.request_id


def _same_as_sync(model: str, prompts, stopping, **kw) -> list:
    """generate() with and without async scheduling: equal tokens, text and finish reasons."""
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model, dtype="float32", async_scheduling=async_scheduling, **kw)
        seen = _watch_pipeline(llm)
        outs = llm.generate(prompts, SamplingParams(), stopping)
        assert_no_leaked_blocks(llm)
        results.append([(o.token_ids, o.text, o.finish_reason) for o in outs])
    assert results[0] == results[1]
    return results[1], seen, llm.scheduler


def test_async_prefix_caching_with_preemption_equals_sync(tiny_models):
    """Shared prefixes in a cache too small for the batch: prefix hits, preemption and resumed
    requests (hashes from known tokens only) with a token in flight."""
    model = tiny_models("llama")
    rng = random.Random(8)
    prefix = [rng.randrange(3, 500) for _ in range(13)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(0, 9))]
               for _ in range(10)]
    _, seen, sched = _same_as_sync(model, prompts, StoppingParams(max_tokens=14, ignore_eos=True),
                                   num_kv_blocks=16, block_size=4, max_num_seqs=6,
                                   max_num_batched_tokens=32)
    assert seen["preempted"] > 0 and seen["depth"] == 2 and sched.prefix_cache_hit_rate > 0.2, (
        seen, sched.prefix_cache_hit_rate)


def test_async_max_model_len_edge_and_max_tokens_one(tiny_models):
    """Requests that reach max_model_len exactly (the last token sits at position max_len - 1,
    never computed), max_tokens=1, and several requests finishing in the same step."""
    model = tiny_models("qwen3")
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (23, 20, 13, 5, 5, 5)]
    outs, _, _ = _same_as_sync(model, prompts, StoppingParams(max_tokens=None, ignore_eos=True),
                               num_kv_blocks=64, block_size=4, max_model_len=24)
    assert [len(t) for t, _, _ in outs] == [1, 4, 11, 19, 19, 19]
    outs, _, _ = _same_as_sync(model, prompts, StoppingParams(max_tokens=1, ignore_eos=True),
                               num_kv_blocks=64, block_size=4, max_model_len=24)
    assert all(len(t) == 1 for t, _, _ in outs)
