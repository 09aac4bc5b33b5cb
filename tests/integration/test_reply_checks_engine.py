"""The step-reply checks (scheduler_service/core/reply_checks.py) never refuse a legitimate reply
of the real engine: a refusal is an outage (every stream ends UNAVAILABLE). Driven through the
in-process engine on a tiny model whose config vocab_size is padded past its tokenizer (as
Qwen's 151936 rows over a 151665-token tokenizer): a padded id is one the model can sample, as
transformers would, and so can its top alternatives; with n-gram drafts sync and async (runs of
accepted drafts and bonus tokens), top and prompt logprobs, and preemption in a small pool."""
from __future__ import annotations

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from tests.integration.test_spec_decode import SPEC
from tests.support.engine_checks import assert_no_leaked_blocks

PAD = 64                      # config rows past the tokenizer's ids


def _padded_model(tiny_models):
    from engine_common.text.tokenizer import Tokenizer

    plain = tiny_models("qwen3")
    size = Tokenizer.from_dir(plain).vocab_size
    return tiny_models("qwen3", vocab_size=size + PAD), size + PAD


def _assert_drafted(llm: LLM, asynchronous: bool) -> None:
    """Drafts went out: sync, some accepted; async, guessed over the step in flight (here the
    workers drop them: the guess fails on the serial CPU runner)."""
    stats = llm.scheduler.spec.stats
    assert (stats.num_dropped if asynchronous else stats.num_accepted_tokens) > 0, stats


@pytest.mark.parametrize("spec,asynchronous", [(False, False), (True, False), (True, True)])
def test_a_padded_id_sampled_with_its_alternatives_is_a_valid_reply(tiny_models, spec,
                                                                    asynchronous):
    model, vocab = _padded_model(tiny_models)
    llm = LLM(model, dtype="float32", num_kv_blocks=128, async_scheduling=asynchronous,
              speculative_config=SPEC if spec else None)
    assert llm.model_info.vocab_size == vocab
    last = vocab - 1                       # a padding row: no token of the tokenizer
    prompts = [[5, 6, 7, 8], [9, 10, 11, 9, 10, 11, 9, 10], [20, 21]]
    samplings = [SamplingParams(allowed_token_ids=(last,)),
                 SamplingParams(logit_bias=((last, 100.0),)),
                 SamplingParams(temperature=0.8, seed=3, allowed_token_ids=(last, 7))]
    got = llm.generate(prompts, samplings, StoppingParams(max_tokens=12, ignore_eos=True),
                       num_logprobs=3, num_prompt_logprobs=2)
    for c in got[:2]:
        assert c.token_ids == [last] * 12, c.token_ids
    assert set(got[2].token_ids) <= {last, 7} and len(got[2].token_ids) == 12
    if spec:
        _assert_drafted(llm, asynchronous)
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_drafts_preemption_and_logprobs_in_a_small_pool(tiny_models, asynchronous):
    """Repetitive prompts (drafts accepted, bonus tokens) in a pool too small for all of them
    (preempted and resumed with steps in flight): the tokens of speculation off, sync."""
    model, _ = _padded_model(tiny_models)
    prompts = [[3 + i, 4, 5, 6] * 3 for i in range(8)]
    stop = StoppingParams(max_tokens=20, ignore_eos=True)
    on = LLM(model, dtype="float32", num_kv_blocks=12, block_size=4,
             async_scheduling=asynchronous, speculative_config=SPEC)
    off = LLM(model, dtype="float32", num_kv_blocks=128)
    preempted, schedule = [], on.scheduler.schedule
    on.scheduler.schedule = lambda: (out := schedule(), preempted.extend(out.preempted_handles))[0]
    # half repeat one id (the n-gram drafts of its history hold: runs and bonus tokens)
    sampling = [SamplingParams(logit_bias=((7, 100.0),)) if i % 2 else SamplingParams()
                for i in range(len(prompts))]
    got = on.generate(prompts, sampling, stop, num_logprobs=2, num_prompt_logprobs=1)
    want = off.generate(prompts, sampling, stop, num_logprobs=2, num_prompt_logprobs=1)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert preempted
    _assert_drafted(on, asynchronous)
    assert_no_leaked_blocks(on)
