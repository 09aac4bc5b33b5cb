"""n-gram speculative decoding with async scheduling through the in-process engine on the tiny
models (fp32): two steps in flight, so a step's drafts are proposed before the step before it
is back (spec_assumed). Greedy tokens equal transformers', speculation off and speculation with
sync scheduling; sampled, penalised and min_tokens requests, stop strings, stop ids and
max_tokens inside a run of drafts, aborts while a drafted step is in flight, preemption in a
small pool: the tokens of speculation off, and no KV block left. Every test runs serial (as
the CPU does) and pipelined (as CUDA does: deltaserve.llm_executor.RunnerPipeline)."""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM, Completion
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from tests.integration.test_spec_decode import MAX_NEW, SPEC, _check_hf, _greedy, _prompts
from tests.support.engine_checks import assert_no_leaked_blocks
from worker_service.runner.model_runner import ModelRunner


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "pipelined"])
def pipelined(request, monkeypatch):
    """Force the runner's pipelining on or off (a CPU runner has it off by default)."""
    init = ModelRunner.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pipelined = request.param
    monkeypatch.setattr(ModelRunner, "__init__", patched)
    return request.param


def _llm(model: str, spec: bool, asynchronous: bool, **kw) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 128, **kw}
    return LLM(model, speculative_config=SPEC if spec else None,
               async_scheduling=asynchronous, **kw)


def _watch(llm: LLM) -> dict:
    """Count the steps whose drafts assumed the step in flight, and preemptions."""
    seen = {"assumed": 0, "preempted": 0}
    schedule = llm.scheduler.schedule

    def watched():
        out = schedule()
        seen["assumed"] += len(out.spec_assumed)
        seen["preempted"] += len(out.preempted_handles)
        return out
    llm.scheduler.schedule = watched
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_equals_transformers_sync_speculation_and_none(tiny_models, arch):
    model = tiny_models(arch)
    prompts = _prompts()
    on = _llm(model, True, True)
    seen = _watch(on)
    got = _greedy(on, prompts)
    sync = _greedy(_llm(model, True, False), prompts)
    off = _greedy(_llm(model, False, False), prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in sync] == \
        [o.token_ids for o in off]
    _check_hf(model, prompts, got, arch)
    stats = on.scheduler.spec.stats
    assert seen["assumed"] > 0, seen
    if arch == "qwen3":     # the tiny llama seldom repeats itself: guesses seldom hold
        assert stats.num_accepted_tokens > 0, stats
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens <= stats.num_draft_tokens
    assert_no_leaked_blocks(on)
    for p, w in zip(prompts[:3], off):             # one at a time: nothing else in the steps
        assert _greedy(on, [p])[0].token_ids == w.token_ids
    assert_no_leaked_blocks(on)


def test_sampled_penalised_and_min_tokens_requests(tiny_models):
    """Each draft is drawn with its own position's counter, history and length, also when it
    was proposed over a step in flight: the tokens and logprobs of speculation off."""
    model = tiny_models("qwen3")
    prompts = _prompts()
    samplings = [SamplingParams(temperature=0.3, seed=1), SamplingParams(temperature=0.7, seed=2),
                 SamplingParams(temperature=0.5, seed=11, repetition_penalty=1.3),
                 SamplingParams(frequency_penalty=0.4, presence_penalty=-0.3),
                 SamplingParams(temperature=1.0, top_k=5, seed=3), SamplingParams(seed=6),
                 SamplingParams(temperature=0.6, seed=5, logit_bias=((7, 2.0), (99, -3.0))),
                 SamplingParams(temperature=0.1, seed=7)]
    stoppings = [StoppingParams(max_tokens=MAX_NEW, ignore_eos=True)] * 6 + [
        StoppingParams(max_tokens=MAX_NEW, min_tokens=8, stop_token_ids=(4, 5, 17, 99))] * 2
    on, off = _llm(model, True, True), _llm(model, False, False)
    got = on.generate(prompts, samplings, stoppings, num_logprobs=0)
    want = off.generate(prompts, samplings, stoppings, num_logprobs=0)
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(g.logprobs, w.logprobs))
    assert on.scheduler.spec.stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(on)


def test_stop_strings_ids_and_max_tokens_inside_runs(tiny_models):
    model = tiny_models("qwen3")
    prompts = _prompts()[:3]
    on, off = _llm(model, True, True), _llm(model, False, False)
    free = _greedy(off, prompts, max_new=30)
    for p, f in zip(prompts, free):
        cuts = {f.text[i:i + 2] for i in range(4, len(f.text) - 2, 5) if f.text[i:i + 2].strip()}
        stops = [StoppingParams(max_tokens=30, ignore_eos=True, stop=[s])
                 for s in sorted(cuts)[:3]]
        stops += [StoppingParams(max_tokens=30, stop_token_ids=(f.token_ids[j],))
                  for j in (3, 9, 17)]
        stops += [StoppingParams(max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 5, 8)]
        for st in stops:
            a = on.generate([p], SamplingParams(), st)[0]
            b = off.generate([p], SamplingParams(), st)[0]
            assert (a.token_ids, a.text, a.finish_reason) == \
                (b.token_ids, b.text, b.finish_reason), st
    assert on.scheduler.spec.stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(on)


def test_preemption_in_a_small_pool(tiny_models):
    model = tiny_models("qwen3")
    prompts = _prompts()
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "num_kv_blocks": 12}
    on = _llm(model, True, True, **kw)
    seen = _watch(on)
    got, want = _greedy(on, prompts), _greedy(_llm(model, False, False), prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert seen["preempted"] > 0 and seen["assumed"] > 0, seen
    assert_no_leaked_blocks(on)


def test_aborts_while_drafted_steps_are_in_flight(tiny_models):
    """Aborts between steps, with a step in flight: the others end as speculation off does,
    an aborted one with a prefix of those tokens; nothing held afterwards."""
    model = tiny_models("qwen3")
    prompts = _prompts()
    st = StoppingParams(max_tokens=MAX_NEW, ignore_eos=True)
    want = _greedy(_llm(model, False, False), prompts)
    llm = _llm(model, True, True, max_num_seqs=8)
    engine, rng = llm.engine, random.Random(4)
    got = {f"a{i}": Completion(f"a{i}", p) for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"a{i}", p, SamplingParams(), st,
                                   llm.model_info.eos_token_ids))
    aborted = set()
    while engine.has_unfinished_requests():
        outs = engine.step()
        live = sorted(engine.scheduler._requests)
        if engine.core._in_flight and live and rng.random() < 0.25:
            aborted.add(rid := rng.choice(live))
            outs += engine.abort([rid])
        for out in outs:
            LLM._merge(got[out.request_id], out)
    assert 2 <= len(aborted) < len(prompts), aborted
    for i, w in enumerate(want):
        g = got[f"a{i}"]
        if g.request_id in aborted:
            assert g.finish_reason == RequestStatus.FINISHED_ABORTED
            assert g.token_ids == w.token_ids[:len(g.token_ids)]
        else:
            assert g.token_ids == w.token_ids, g.request_id
    assert_no_leaked_blocks(llm)
