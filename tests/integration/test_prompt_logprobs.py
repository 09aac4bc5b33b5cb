"""Prompt logprobs (vLLM's prompt_logprobs) from the offline LLM and the engine, on a real tiny
model, against transformers' float32 log_softmax over the same weights: each prompt token's
logprob (atol 1e-4), its rank and the top-k ids, with None first; the whole prompt in one step
and chunked over steps (the last position of a chunk predicts the next chunk's first token),
with the async (pipelined) engine too; with prefix caching on, a request asking for them skips
the cache and still gets every position, while one that does not ask still hits it; a preempted
and recomputed request gets them once; nothing is left behind (blocks, the worker's book); and
a request that does not ask for them never reaches their code."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from scheduler_service.engine.output_processor import OutputProcessor
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.prompt_logprobs_reference import assert_matches_hf
from worker_service.sample import prompt_logprobs as plp

PROMPTS = [list(range(5, 25)), [7, 3, 99, 41, 8, 8, 12], [300, 2, 17]]
STOP = StoppingParams(max_tokens=3, ignore_eos=True)


def _llm(model: str, **kw) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4, **kw}
    return LLM(model, **kw)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def whole(model):
    """Prompts prefilled in one step each (the budget holds them all)."""
    return _llm(model, max_num_batched_tokens=64)


@pytest.mark.parametrize("k", [0, 3])
def test_whole_prompt_equals_transformers(whole, model, k):
    outs = whole.generate(PROMPTS, None, STOP, num_prompt_logprobs=k)
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_hf(out.prompt_logprobs, model, prompt, k)
        assert all(len(e.top_token_ids) == k for e in out.prompt_logprobs[1:])
        assert len(out.token_ids) == 3
    assert not whole.runner.prompt_logprobs          # the worker keeps nothing after
    assert_no_leaked_blocks(whole)


def test_without_the_option_there_are_none(whole):
    out = whole.generate(PROMPTS[:1], None, STOP)[0]
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_equals_transformers(model, async_scheduling):
    """8 tokens a step: the 20-token prompt spans three steps, the others share them."""
    llm = _llm(model, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    llm.runner.pipelined = async_scheduling       # launch t+1 before finishing t, on the CPU
    steps = []
    plan = llm.runner.prompt_logprobs.plan

    def counted(batch, inputs):
        step = plan(batch, inputs)
        steps.append(step)
        return step
    llm.runner.prompt_logprobs.plan = counted
    outs = llm.generate(PROMPTS, None, STOP, num_prompt_logprobs=2)
    for prompt, out in zip(PROMPTS, outs):
        assert_matches_hf(out.prompt_logprobs, model, prompt, 2)
    chunks = [c for s in steps if s is not None for c in s.chunks]
    assert sum(c.rows for c in chunks) == sum(len(p) - 1 for p in PROMPTS)
    assert len([c for c in chunks if c.entry.prompt[0] == 5]) >= 3     # split over steps
    assert_no_leaked_blocks(llm)


def test_prefix_caching_does_not_serve_them(model):
    llm = _llm(model, max_num_batched_tokens=64, enable_prefix_caching=True)
    shared = list(range(40, 56))                   # four full blocks
    first = llm.generate([shared + [3]], None, STOP)[0]       # fills the prefix cache
    asked = llm.generate([shared + [9, 4]], None, STOP, num_prompt_logprobs=1)[0]
    again = llm.generate([shared + [9, 5]], None, STOP)[0]
    assert first.num_cached_tokens == 0
    assert asked.num_cached_tokens == 0           # no lookup for it: every position computed
    assert_matches_hf(asked.prompt_logprobs, model, shared + [9, 4], 1)
    assert again.num_cached_tokens == 16          # others still hit (its blocks cached too)
    assert_no_leaked_blocks(llm)


def test_a_preempted_request_gets_them_once(model):
    """10 blocks of 4 tokens for three 14-token requests: the last ones are preempted and
    recomputed; each request's prompt logprobs come once, with its first token."""
    llm = _llm(model, num_kv_blocks=10, max_num_batched_tokens=32)
    engine = llm.engine
    engine.output_processor = OutputProcessor(llm.tokenizer)      # every step's outputs
    prompts = {f"p{i}": [11 + i, 60, 7 + i, 33, 2, 90 + i] for i in range(3)}
    requests = [Request(rid, list(p), SamplingParams(), StoppingParams(max_tokens=8,
                ignore_eos=True), llm.model_info.eos_token_ids, num_prompt_logprobs=2)
                for rid, p in prompts.items()]
    for r in requests:
        engine.add_request(r)
    got: dict[str, list] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].append(out.prompt_logprobs)
    assert sum(r.num_preemptions for r in requests) > 0
    for rid, outs in got.items():
        sent = [p for p in outs if p is not None]
        assert len(sent) == 1 and outs[0] is sent[0], rid
        assert_matches_hf(sent[0], model, prompts[rid], 2)
    assert not llm.runner.prompt_logprobs
    assert_no_leaked_blocks(llm)


def test_requests_without_them_never_reach_their_code(whole, monkeypatch):
    """No plan, no launch, no extra tensor: a step without such requests stops at one falsy
    check of the worker's book (and the reply has no prompt field)."""
    def boom(*a, **k):
        raise AssertionError("prompt logprob code ran for requests that did not ask")
    monkeypatch.setattr(plp.PromptLogprobStep, "launch", boom)
    monkeypatch.setattr(plp, "token_logprobs", boom)
    monkeypatch.setattr(plp.PromptLogprobBook, "record", boom)
    replies = []
    finish = whole.runner.finish_step

    def kept(pending):
        assert pending.prompt_logprobs is None
        out = finish(pending)
        replies.append(out)
        return out
    monkeypatch.setattr(whole.runner, "finish_step", kept)
    outs = whole.generate(PROMPTS, SamplingParams(temperature=0.7, seed=1), STOP,
                          num_logprobs=2)
    assert all(o.prompt_logprobs is None and len(o.token_ids) == 3 for o in outs)
    assert replies and all(r.prompt_logprobs == {} for r in replies)


@pytest.mark.parametrize("value", [-1, 21 + 300, True, 1.5])
def test_bad_values_are_refused_by_name(whole, value):
    with pytest.raises(ParamError) as err:
        whole.generate(PROMPTS[:1], None, STOP, num_prompt_logprobs=value)
    assert "num_prompt_logprobs" in str(err.value) and "[0, " in str(err.value)


def test_chat_passes_them_for_the_rendered_prompt(whole, model):
    """LLM.chat takes num_prompt_logprobs as generate() does, over the rendered prompt's ids."""
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    out = whole.chat([{"role": "user", "content": "hello there"}], None, STOP,
                     chat_template=template, add_generation_prompt=False,
                     num_prompt_logprobs=2)[0]
    assert len(out.prompt_token_ids) > 2
    assert_matches_hf(out.prompt_logprobs, model, out.prompt_token_ids, 2)
