"""n-gram speculative decoding for structured-output and top-logprob requests through the
in-process engine on the tiny qwen3 model (fp32): JSON-schema, regex and choice constraints
draft (their prompts hold the text the grammar forces, so drafts are found and kept), and their
tokens and logprobs equal speculation off and, greedy, transformers' greedy under the same
grammar; sampled with seeds too; sync and async scheduling, serial and pipelined runner."""
from __future__ import annotations

import json

import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import RequestStatus
from tests.integration.test_spec_decode import SPEC
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import hf_greedy_guided
from tests.support.pipelining import pipelined  # noqa: F401 (autouse fixture)

MAX_NEW = 48
SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["alpha beta gamma delta", "omega sigma tau"]},
    "tags": {"type": "array", "items": {"enum": ["red green", "blue yellow"]},
             "minItems": 2, "maxItems": 3}},
    "required": ["name", "tags"], "additionalProperties": False}
CASES = [
    (Constraint("json_schema", json.dumps(SCHEMA)),
     '{"name": "alpha beta gamma delta", "tags": ["red green", "blue yellow", "red green"]}'),
    (Constraint("regex", "(abc|xyz){4}-[0-9]{2}"), "abcxyzabcabc-12 xyzxyzabcxyz-34"),
    (Constraint("choice", ("the quick brown fox jumps over", "a lazy dog sleeps all day")),
     "the quick brown fox jumps over; a lazy dog sleeps all day"),
]


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models("qwen3")


def _llm(model: str, spec: bool, asynchronous: bool = False) -> LLM:
    return LLM(model, dtype="float32", num_kv_blocks=128, async_scheduling=asynchronous,
               speculative_config=SPEC if spec else None)


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(text) for _, text in CASES]


def _run(llm: LLM, samplings, **kw):
    """The CASES, then an unconstrained request in the same batches (its drafts beside the
    constrained rows' masked ones)."""
    constraints = [c for c, _ in CASES] + [None]
    prompts = _prompts(llm)
    return llm.generate(prompts + [prompts[-1]], samplings + samplings[:1],
                        StoppingParams(max_tokens=MAX_NEW), constraint=constraints, **kw)


def _same(got, want) -> None:
    for g, w in zip(got, want):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        assert len(g.logprobs) == len(w.logprobs)
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert a.top_token_ids == b.top_token_ids
            assert all(abs(x - y) < 1e-4 for x, y in zip(a.top_logprobs, b.top_logprobs))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_greedy_constrained_drafts_equal_speculation_off_and_transformers(model, asynchronous,
                                                                          pipelined):
    if pipelined and not asynchronous:
        pytest.skip("the pipelined runner runs with async scheduling only")
    on, off = _llm(model, True, asynchronous), _llm(model, False)
    greedy = [SamplingParams()] * len(CASES)
    got, want = _run(on, greedy, num_logprobs=3), _run(off, greedy, num_logprobs=3)
    _same(got, want)
    stats = on.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > 0, stats
    if asynchronous:       # drafts over the step in flight, some dropped: the matcher follows
        assert stats.num_dropped > 0, stats
    compiler = on.runner.grammar.compiler
    eos = on.model_info.eos_token_ids
    for (constraint, _), prompt, out in zip(CASES, _prompts(on), got):
        ref = hf_greedy_guided(model, tuple(prompt), MAX_NEW, compiler.matcher(constraint), eos)
        assert tuple(out.token_ids) == ref, constraint.kind
    # the regex and the choice end inside MAX_NEW (the JSON may wander in its whitespace)
    assert [o.finish_reason for o in got[1:3]] == [RequestStatus.FINISHED_STOP_TOKEN] * 2
    assert_no_leaked_blocks(on)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_sampled_constrained_drafts_equal_speculation_off(model, asynchronous, pipelined):
    if pipelined and not asynchronous:
        pytest.skip("the pipelined runner runs with async scheduling only")
    on, off = _llm(model, True, asynchronous), _llm(model, False)
    for seed in (1, 2):
        samplings = [SamplingParams(temperature=t, seed=seed + i)
                     for i, t in enumerate((0.3, 0.8, 1.0))]
        _same(_run(on, samplings, num_logprobs=2), _run(off, samplings, num_logprobs=2))
    assert on.scheduler.spec.stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(on)


def test_min_tokens_past_the_grammars_end(model):
    """min_tokens beyond where the grammar completes: the grammar wins (eos is not masked where
    only eos may follow), also at a draft position, so the run ends there as without drafts."""
    on, off = _llm(model, True), _llm(model, False)
    constraints = [c for c, _ in CASES[1:]]
    prompts = _prompts(on)[1:]
    stop = StoppingParams(max_tokens=MAX_NEW, min_tokens=40)
    for samplings in ([SamplingParams()] * 2, [SamplingParams(temperature=0.5, seed=4)] * 2):
        got = on.generate(prompts, samplings, stop, constraint=constraints)
        want = off.generate(prompts, samplings, stop, constraint=constraints)
        assert [(o.token_ids, o.finish_reason) for o in got] == \
            [(o.token_ids, o.finish_reason) for o in want]
        assert all(o.finish_reason == RequestStatus.FINISHED_STOP_TOKEN for o in got)
    assert on.scheduler.spec.stats.num_accepted_tokens > 0


def _same_prompt_logprobs(got, want) -> None:
    for g, w in zip(got, want):
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) > 1
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_stop_strings_ignore_eos_and_logprobs_0_with_prompt_logprobs(model, asynchronous,
                                                                    pipelined):
    """Constrained drafts beside the other output knobs, equal to speculation off: a stop
    string inside an accepted run (the choice), ignore_eos (the regex ends, eos is taken and
    decoding goes on unconstrained, drafting), each token's own logprob alone
    (num_logprobs=0) and prompt logprobs, greedy and sampled."""
    if pipelined and not asynchronous:
        pytest.skip("the pipelined runner runs with async scheduling only")
    on, off = _llm(model, True, asynchronous), _llm(model, False)
    constraints = [c for c, _ in CASES]
    prompts = _prompts(on)
    stops = [StoppingParams(max_tokens=MAX_NEW),
             StoppingParams(max_tokens=MAX_NEW, ignore_eos=True),
             StoppingParams(max_tokens=MAX_NEW, stop=("fox jumps",))]
    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, seed=3)):
        kw = dict(num_logprobs=0, num_prompt_logprobs=2, constraint=constraints)
        got = on.generate(prompts, [sampling] * 3, stops, **kw)
        want = off.generate(prompts, [sampling] * 3, stops, **kw)
        _same(got, want)
        _same_prompt_logprobs(got, want)
        assert [g.text for g in got] == [w.text for w in want]
        assert got[1].finish_reason == RequestStatus.FINISHED_LENGTH      # ignore_eos
        assert got[2].finish_reason == RequestStatus.FINISHED_STOP_STRING
    assert on.scheduler.spec.stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(on)
