"""n-gram speculative decoding through the whole in-process engine on the tiny models: greedy
tokens equal transformers' greedy and speculation off, with chunked prefill, preemption and
prefix caching; sampled requests, penalised ones, ones with logit_bias, id sets or min_tokens
draft too and get the tokens of speculation off; logprobs, stop strings and top-logprob
requests in the same batches (constrained ones: test_spec_decode_grammar.py)."""
from __future__ import annotations

import random

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
MAX_NEW = 24


def _prompts(vocab: int = 500) -> list[list[int]]:
    """Prompts with repetition (drafts found and, where the model repeats, accepted) and
    random ones (few drafts)."""
    rng = random.Random(3)
    out = [[5, 17, 99, 42, 7] * 6, [200] * 7, [3, 4, 5, 6] * 5, list(range(40, 90))]
    for n in (9, 33, 70, 1):
        part = [rng.randrange(3, vocab) for _ in range(n)]
        out.append(part + part[: n // 2])
    return out


def _llm(model: str, spec: bool, **kw) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 128, **kw}
    return LLM(model, speculative_config=SPEC if spec else None, **kw)


def _greedy(llm: LLM, prompts, max_new=MAX_NEW, **kw):
    return llm.generate(prompts, SamplingParams(),
                        StoppingParams(max_tokens=max_new, ignore_eos=True), **kw)


def _check_hf(model: str, prompts, outs, label: str) -> None:
    near_ties, failures = [], []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        failure = compare_greedy(f"{label}/prompt{i}", out.token_ids,
                                 hf_greedy(model, tuple(p), MAX_NEW), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)


# glm4 / cohere2: q/k rows reordered at load (pair_rope.py); cohere2's scaled logits off the
# fused greedy head and rope-less full layers beside windowed ones
@pytest.mark.parametrize("arch", ["qwen3", "llama", "glm4", "cohere2"])
def test_greedy_equals_transformers_and_speculation_off(tiny_models, arch):
    model = tiny_models(arch)
    prompts = _prompts()
    on, off = _llm(model, True), _llm(model, False)
    got, want = _greedy(on, prompts), _greedy(off, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    _check_hf(model, prompts, got, arch)
    stats = on.scheduler.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert_no_leaked_blocks(on)
    # One at a time too (no other request in the batch).
    for p, w in zip(prompts[:3], want):
        assert _greedy(on, [p])[0].token_ids == w.token_ids
    assert_no_leaked_blocks(on)


def test_chunked_prefill_preemption_and_prefix_caching(tiny_models):
    model = tiny_models("qwen3")
    prompts = _prompts()
    prompts += [prompts[0] + [11, 12], prompts[6][:40] + [8]]     # shared prefixes
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "num_kv_blocks": 12}
    on = _llm(model, True, **kw)
    preempted = []
    preempt = on.scheduler._preempt
    on.scheduler._preempt = lambda r, plan: (preempted.append(r.request_id), preempt(r, plan))
    got = _greedy(on, prompts)
    _check_hf(model, prompts, got, "small-pool")
    assert preempted, "the small pool should preempt"
    again = _greedy(on, prompts)                # the prompts' blocks are cached now
    assert [o.token_ids for o in again] == [o.token_ids for o in got]
    assert on.scheduler.prefix_cache_hit_rate > 0
    assert on.scheduler.spec.stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(on)


def test_logprobs_of_accepted_tokens(tiny_models):
    model = tiny_models("qwen3")
    prompts = _prompts()[:4]
    on, off = _llm(model, True), _llm(model, False)
    got, want = _greedy(on, prompts, num_logprobs=0), _greedy(off, prompts, num_logprobs=0)
    assert on.scheduler.spec.stats.num_accepted_tokens > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [lp.token_id for lp in g.logprobs] == g.token_ids
        assert len(g.logprobs) == len(w.logprobs) == MAX_NEW
        for a, b in zip(g.logprobs, w.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
    assert_no_leaked_blocks(on)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_sampled_requests_draft_and_get_the_tokens_of_speculation_off(tiny_models, arch):
    """Sampled requests (temperature, top-k, top-p, min-p; low temperatures so that drafts of
    the random tiny models are sometimes right) draft;
    each draft is kept or replaced by the draw one-token decoding makes there, so the tokens
    equal speculation off, with both acceptances and rejections in the run."""
    model = tiny_models(arch)
    prompts = _prompts()
    samplings = [SamplingParams(temperature=0.3, seed=1), SamplingParams(temperature=0.7, seed=2),
                 SamplingParams(temperature=1.0, top_k=5, seed=3),
                 SamplingParams(temperature=0.8, top_p=0.7, seed=4),
                 SamplingParams(temperature=1.0, min_p=0.2, seed=5), SamplingParams(seed=6),
                 SamplingParams(temperature=0.1, seed=7), SamplingParams(temperature=0.05, seed=8)]
    st = StoppingParams(max_tokens=MAX_NEW, ignore_eos=True)
    on, off = _llm(model, True), _llm(model, False)
    got, want = on.generate(prompts, samplings, st), off.generate(prompts, samplings, st)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = on.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0, stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens, stats
    assert_no_leaked_blocks(on)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_penalties_biases_id_sets_and_min_tokens_draft(tiny_models, arch):
    """Penalties and min_tokens depend on the tokens before each draft position, logit_bias and
    id sets on none: each draft is drawn with its own position's history, so these requests
    draft and get the tokens (and each token's logprob) of speculation off."""
    model = tiny_models(arch)
    prompts = _prompts()[:8]
    samplings = [SamplingParams(temperature=0.5, seed=11, repetition_penalty=1.3),
                 SamplingParams(temperature=0.4, seed=12, frequency_penalty=0.6),
                 SamplingParams(temperature=0.6, seed=13, presence_penalty=0.8, top_k=8),
                 SamplingParams(repetition_penalty=1.2),
                 SamplingParams(frequency_penalty=0.4, presence_penalty=-0.3),
                 SamplingParams(temperature=0.6, seed=5, logit_bias=((7, 2.0), (42, 1.5),
                                                                     (99, -3.0))),
                 SamplingParams(temperature=0.4, seed=6, allowed_token_ids=tuple(range(3, 120))),
                 SamplingParams(temperature=0.9, seed=7, min_p=0.1, repetition_penalty=1.1,
                                logit_bias=((3, 0.5),))]
    st = StoppingParams(max_tokens=MAX_NEW, ignore_eos=True)
    on, off = _llm(model, True), _llm(model, False)
    got, want = (on.generate(prompts, samplings, st, num_logprobs=0),
                 off.generate(prompts, samplings, st, num_logprobs=0))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [lp.token_id for lp in g.logprobs] == g.token_ids
        for a, b in zip(g.logprobs, w.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
    stats = on.scheduler.spec.stats
    assert stats.num_draft_tokens > 0, stats
    if arch == "qwen3":      # the tiny llama seldom repeats itself: few drafts kept
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    # min_tokens: the stop ids are masked at every draft position below it
    for p in prompts[:3]:
        free = off.generate([p], SamplingParams(temperature=0.3, seed=21), st)[0]
        stop = StoppingParams(max_tokens=MAX_NEW, min_tokens=8,
                              stop_token_ids=(free.token_ids[2], free.token_ids[5]))
        a = on.generate([p], SamplingParams(temperature=0.3, seed=21), stop)[0]
        b = off.generate([p], SamplingParams(temperature=0.3, seed=21), stop)[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        assert len(a.token_ids) >= 8
    assert_no_leaked_blocks(on)


def test_top_logprob_requests_draft_in_shared_batches(tiny_models):
    """Top-logprob requests draft beside other drafting ones (greedy, sampled and penalised),
    with the tokens, logprobs and alternatives they get without speculation."""
    model = tiny_models("qwen3")
    prompts = _prompts()[:6]
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, seed=5),
                 SamplingParams(repetition_penalty=1.3), SamplingParams(),
                 SamplingParams(temperature=1.0, top_p=0.9, seed=9),
                 SamplingParams(frequency_penalty=0.5)]
    st = StoppingParams(max_tokens=MAX_NEW, ignore_eos=True)
    on, off = _llm(model, True), _llm(model, False)
    got, want = on.generate(prompts, samplings, st), off.generate(prompts, samplings, st)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    before = on.scheduler.spec.stats.num_accepted_tokens
    tops_on = on.generate(prompts[:3], samplings[:3], st, num_logprobs=2)
    tops_off = off.generate(prompts[:3], samplings[:3], st, num_logprobs=2)
    assert on.scheduler.spec.stats.num_accepted_tokens > before     # they drafted
    for a, b in zip(tops_on, tops_off):
        assert a.token_ids == b.token_ids and len(a.logprobs) == MAX_NEW
        assert [lp.top_token_ids for lp in a.logprobs] == [lp.top_token_ids for lp in b.logprobs]
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4
            assert max(abs(p - q) for p, q in zip(x.top_logprobs, y.top_logprobs)) < 1e-4
    # a stop id inside an accepted run: the alternatives end with the token that stopped it
    for p, free in zip(prompts[:3], tops_off):
        stop = StoppingParams(max_tokens=MAX_NEW, stop_token_ids=(free.token_ids[9],))
        a = on.generate([p], SamplingParams(), stop, num_logprobs=2)[0]
        b = off.generate([p], SamplingParams(), stop, num_logprobs=2)[0]
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.token_ids)
        assert [lp.top_token_ids for lp in a.logprobs] == [lp.top_token_ids for lp in b.logprobs]
    assert_no_leaked_blocks(on)


def test_stop_strings_and_ids_cut_where_one_token_decoding_does(tiny_models):
    model = tiny_models("qwen3")
    prompts = _prompts()[:3]
    on, off = _llm(model, True), _llm(model, False)
    free = _greedy(off, prompts, max_new=30)
    for p, f in zip(prompts, free):
        cuts = {f.text[i:i + 2] for i in range(4, len(f.text) - 2, 5) if f.text[i:i + 2].strip()}
        for stop in sorted(cuts)[:4]:
            st = StoppingParams(max_tokens=30, ignore_eos=True, stop=[stop])
            a, b = on.generate([p], SamplingParams(), st)[0], \
                off.generate([p], SamplingParams(), st)[0]
            assert (a.token_ids, a.text, a.finish_reason) == \
                (b.token_ids, b.text, b.finish_reason), stop
        for j in (3, 9, 17):
            st = StoppingParams(max_tokens=30, stop_token_ids=(f.token_ids[j],))
            a, b = on.generate([p], SamplingParams(), st)[0], \
                off.generate([p], SamplingParams(), st)[0]
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert on.scheduler.spec.stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(on)


def test_offline_config_errors_name_the_key(tiny_models):
    from engine_common.request.params import ParamError

    model = tiny_models("qwen3")
    with pytest.raises(ParamError) as e:
        LLM(model, dtype="float32", speculative_config={"method": "ngram",
                                                         "num_speculative_tokens": 0})
    assert e.value.field == "speculative_config.num_speculative_tokens"
    with pytest.raises(ParamError) as e:     # refused with async scheduling too
        LLM(model, dtype="float32", async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                "prompt_lookup_min": 9, "prompt_lookup_max": 3})
    assert e.value.field == "speculative_config.prompt_lookup_max"
