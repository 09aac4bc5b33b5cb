"""Speculative decoding against a real TP=2 layout (one worker service with two rank processes,
gloo on CPU, symmetry verification on: both ranks must verify the drafts alike every step): the
tokens equal the TP=1 in-process reference without speculation, drafts are accepted, and the
workers end holding no request. Greedy and sampled requests draft, penalised and biased
ones and ones under min_tokens too; with sync and with async scheduling (drafts proposed over
the step in flight: every rank drops or verifies them alike). Constrained requests draft too:
every rank walks its matcher through the drafts and masks each position alike."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine_common.request.params import SamplingParams, StoppingParams
from engine_common.text.tokenizer import Tokenizer
from tests.integration.test_spec_decode_grammar import CASES
from tests.support.tp_harness import engine_on, reference, run_requests, scheduler_config

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1})


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_tp2_with_drafts_matches_tp1_without(tp2, tiny_models, asynchronous):
    model = tiny_models("qwen3")      # its greedy output falls into loops: drafts accepted
    prompts = [[5, 17, 99, 42, 7] * 6, [200] * 7, [3, 4, 5, 6] * 5, list(range(40, 70)),
               [9, 8, 7, 9, 8, 7, 100], [3, 4, 5, 6] * 5, [5, 17, 99, 42, 7] * 6]
    # Greedy and sampled drafts: both ranks draw the same noise for each draft position, with
    # the same per-position history (penalties), length (min_tokens) and bias pairs.
    samplings = [SamplingParams()] * 3 + [SamplingParams(temperature=0.1, seed=11),
                                          SamplingParams(temperature=0.9, seed=3),
                                          SamplingParams(frequency_penalty=0.3),
                                          SamplingParams(temperature=0.2, seed=5,
                                                         repetition_penalty=1.05,
                                                         logit_bias=((7, 1.0), (99, -2.0)))]
    stoppings = [StoppingParams(max_tokens=16, ignore_eos=True)] * 5 + [
        StoppingParams(max_tokens=16, min_tokens=6, stop_token_ids=(4, 5, 17))] * 2
    expected, _ = reference(model, prompts, samplings, stoppings)
    config = dataclasses.replace(scheduler_config(), speculative_config=SPEC,
                                 async_scheduling=asynchronous)
    assumed = []
    with engine_on(tp2, model, config) as core:
        schedule = core.scheduler.schedule
        core.scheduler.schedule = lambda: assumed.append(out := schedule()) or out
        got = run_requests(core, model, prompts, samplings, stoppings)
        stats = core.scheduler.spec.stats
    assert got == expected
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    # async: drafts over the step in flight were sent (and some of them verified)
    assert any(out.spec_assumed for out in assumed) == asynchronous


def test_tp2_constrained_drafts_match_tp1_without(tp2, tiny_models):
    """JSON-schema, regex and choice requests draft (their prompts hold the forced text): each
    rank computes every draft position's mask from its own matcher (the symmetry digest covers
    the masks), and the tokens equal TP=1 without speculation, greedy and sampled."""
    model = tiny_models("qwen3")
    tokenizer = Tokenizer.from_dir(model)
    prompts = [tokenizer.encode(text)[:64] for _, text in CASES] * 2    # max_model_len 96
    constraints = [c for c, _ in CASES] * 2
    samplings = [SamplingParams()] * 3 + [SamplingParams(temperature=0.8, seed=s)
                                          for s in (1, 2, 3)]
    stoppings = [StoppingParams(max_tokens=24)] * 6
    expected, _ = reference(model, prompts, samplings, stoppings, constraints=constraints)
    config = dataclasses.replace(scheduler_config(), speculative_config=SPEC)
    with engine_on(tp2, model, config) as core:
        got = run_requests(core, model, prompts, samplings, stoppings, constraints=constraints)
        stats = core.scheduler.spec.stats
    assert got == expected
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
