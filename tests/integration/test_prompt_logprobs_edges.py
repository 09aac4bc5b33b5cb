"""Prompt logprobs at the edges a vLLM user reaches, on a real tiny model against transformers:
a 1-token prompt gets [None]; sampling knobs (temperature, logit_bias, penalties, top_k, min_p,
min_tokens) do not change them (raw logits, as vLLM); max_tokens=1 and a structured-output
constraint still get them; a request aborted mid-prefill leaves nothing in the worker's book
(sync and pipelined engines) and the handle it frees serves the next request correctly."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.constraints.constraint import Constraint
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.prompt_logprobs_reference import assert_matches_hf

LONG = list(range(5, 40))          # 35 tokens: five steps of 8


def _llm(model: str, **kw) -> LLM:
    kw = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4,
          "max_num_batched_tokens": 8, **kw}
    return LLM(model, **kw)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="module")
def llm(model):
    return _llm(model)


def _left_nothing(llm: LLM) -> None:
    assert not llm.runner.prompt_logprobs, llm.runner.prompt_logprobs._entries
    assert_no_leaked_blocks(llm)


def test_a_one_token_prompt_gets_none_for_its_only_token(llm):
    out = llm.generate([[5]], None, StoppingParams(max_tokens=2, ignore_eos=True),
                       num_prompt_logprobs=3)[0]
    assert out.prompt_logprobs == [None] and len(out.token_ids) == 2
    _left_nothing(llm)


def test_sampling_knobs_do_not_change_them(llm, model):
    knobs = SamplingParams(temperature=0.9, seed=3, logit_bias={7: 50.0, 8: -50.0},
                           presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.7,
                           top_k=3, min_p=0.1)
    outs = llm.generate([LONG[:20], [9, 10, 11]], knobs,
                        StoppingParams(max_tokens=3, min_tokens=2, ignore_eos=True),
                        num_prompt_logprobs=4)
    assert_matches_hf(outs[0].prompt_logprobs, model, LONG[:20], 4)
    assert_matches_hf(outs[1].prompt_logprobs, model, [9, 10, 11], 4)
    _left_nothing(llm)


def test_one_token_of_output_and_a_constraint_still_get_them(llm, model):
    prompt = list(range(30, 47))
    out = llm.generate([prompt], None, StoppingParams(max_tokens=1), num_prompt_logprobs=2)[0]
    assert_matches_hf(out.prompt_logprobs, model, prompt, 2)
    out = llm.generate([prompt], None, StoppingParams(max_tokens=4), num_prompt_logprobs=2,
                       constraint=Constraint("regex", "[ab]+"))[0]
    assert_matches_hf(out.prompt_logprobs, model, prompt, 2)
    _left_nothing(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_mid_prefill_leaves_nothing_and_the_handle_serves_the_next(model,
                                                                             async_scheduling):
    llm = _llm(model, async_scheduling=async_scheduling)
    engine = llm.engine
    for i in range(3):
        engine.add_request(Request(f"a{i}", LONG[i:], SamplingParams(),
                                   StoppingParams(max_tokens=3, ignore_eos=True),
                                   llm.model_info.eos_token_ids, num_prompt_logprobs=3))
    engine.step()
    engine.step()
    assert llm.runner.prompt_logprobs.pending          # prompts half done on the worker
    engine.abort(["a0", "a2"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()                      # the pipelined engine's last finish reaches the worker
    _left_nothing(llm)
    prompt = list(range(50, 70))
    outs = llm.generate([prompt, prompt[:5]], None,
                        StoppingParams(max_tokens=2, ignore_eos=True), num_prompt_logprobs=2)
    assert_matches_hf(outs[0].prompt_logprobs, model, prompt, 2)
    assert_matches_hf(outs[1].prompt_logprobs, model, prompt[:5], 2)
    _left_nothing(llm)
