"""LLM.generate's final-only outputs give the same Completions, field for field, as the same
engine with a per-step OutputProcessor whose outputs are merged: greedy and seeded sampling,
stop strings (text kept token by token), stop ids, min_tokens, logprobs with alternatives, and
requests without stop strings (text decoded once at the finish)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.engine.output_processor import OutputProcessor


def _workload(rng: random.Random, n: int):
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(3, 12))] for _ in range(n)]
    samplings = [SamplingParams() if i % 2 else SamplingParams(temperature=1.0, seed=100 + i)
                 for i in range(n)]
    stoppings = []
    for i in range(n):
        kind = i % 4
        stoppings.append(StoppingParams(
            max_tokens=rng.randint(4, 24), min_tokens=2 if kind == 3 else 0,
            stop=("e", "th") if kind in (1, 3) else (),
            stop_token_ids=(rng.randrange(3, 400),) if kind == 2 else (),
            include_stop_str_in_output=kind == 3))
    return prompts, samplings, stoppings


def _fields(completion) -> tuple:
    return dataclasses.astuple(dataclasses.replace(completion, request_id=""))


def test_final_only_generate_equals_merged_per_step_outputs(tiny_models):
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=256, max_num_seqs=8)
    assert llm.engine.output_processor._final_only
    prompts, samplings, stoppings = _workload(random.Random(8), 16)
    final = llm.generate(prompts, samplings, stoppings, num_logprobs=2)
    assert llm.reset_prefix_cache()
    llm.engine.output_processor = OutputProcessor(llm.tokenizer)       # per-step outputs
    per_step = llm.generate(prompts, samplings, stoppings, num_logprobs=2)
    assert [_fields(c) for c in final] == [_fields(c) for c in per_step]
    assert any(c.stop_reason in ("e", "th") for c in final)            # stop strings matched
    # text is empty only where the tokens spell nothing but an unfinished character (never sent)
    assert all(c.text or set(llm.tokenizer.decode(c.token_ids)) <= {"\ufffd"} for c in final)
    assert sum(not c.text for c in final) <= 1 and all(c.logprobs for c in final)


def _held_workload(rng: random.Random, n: int):
    """Final-only requests whose updates are held until the finish: no stop strings, no top
    alternatives; stop ids, min_tokens, ignore_eos and lengths vary."""
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(3, 12))] for _ in range(n)]
    samplings = [SamplingParams() if i % 2 else SamplingParams(temperature=1.0, seed=7 + i)
                 for i in range(n)]
    # Half the vocabulary as stop ids, so some requests do stop on one.
    stop_ids = [tuple(range(3 + i % 2, 512, 2)) if i % 4 == 2 else () for i in range(n)]
    stoppings = [StoppingParams(max_tokens=rng.randint(4, 40), min_tokens=i % 3,
                                stop_token_ids=stop_ids[i], ignore_eos=i % 5 == 0)
                 for i in range(n)]
    return prompts, samplings, stoppings


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_held_updates_give_the_same_completions(tiny_models, async_scheduling):
    """Requests whose updates are held (one update, at the finish) get the Completions a
    per-step OutputProcessor gives, through preemptions (a small KV cache) and both loops."""
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=10, max_num_seqs=8,
              async_scheduling=async_scheduling)
    seen: dict[str, int] = {}
    preempted = []
    process, preempt = llm.engine.output_processor.process, llm.scheduler._preempt

    def counting(updates):
        for u in updates:
            seen[u.request_id] = seen.get(u.request_id, 0) + 1
        return process(updates)

    def counting_preempt(request, plan):
        preempted.append(request.request_id)
        return preempt(request, plan)
    llm.engine.output_processor.process = counting
    llm.scheduler._preempt = counting_preempt
    prompts, samplings, stoppings = _held_workload(random.Random(3), 16)
    held = llm.generate(prompts, samplings, stoppings, num_logprobs=0)
    assert preempted                                        # the cache was too small for all
    assert set(seen.values()) == {1}                       # one update per request: the final
    assert llm.reset_prefix_cache()
    llm.engine.output_processor = OutputProcessor(llm.tokenizer)       # per-step outputs
    per_step = llm.generate(prompts, samplings, stoppings, num_logprobs=0)
    assert [_fields(c) for c in held] == [_fields(c) for c in per_step]
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in held)
    assert {c.finish_reason for c in held} >= {RequestStatus.FINISHED_LENGTH,
                                               RequestStatus.FINISHED_STOP_TOKEN}


def test_aborting_a_held_request_gives_every_token_so_far(tiny_models):
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=64, max_num_seqs=4)
    engine = llm.engine
    request = Request("held", [5, 6, 7], SamplingParams(), StoppingParams(max_tokens=50),
                      llm.model_info.eos_token_ids)
    engine.add_request(request)
    assert request.held_logprobs == []
    outputs = []
    while len(request.output_token_ids) < 5:
        outputs += engine.step()
    assert outputs == []                                   # nothing before the finish
    (final,) = engine.abort(["held"])
    assert final.finished and final.finish_reason == RequestStatus.FINISHED_ABORTED
    assert final.new_token_ids == request.output_token_ids and len(final.logprobs) == 5
    assert final.new_text == llm.tokenizer.decode(request.output_token_ids)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_per_request_through_generate(tiny_models, skip):
    """The eos token sampled under ignore_eos (allowed_token_ids forces it): its text is in the
    Completion only with skip_special_tokens false, as the tokenizer decodes it."""
    llm = LLM(tiny_models("qwen3"), num_kv_blocks=64, max_num_seqs=2)
    eos = llm.tokenizer.eos_token_id
    out, = llm.generate([[5, 6, 7]], SamplingParams(allowed_token_ids=(eos,)),
                        StoppingParams(max_tokens=3, ignore_eos=True, skip_special_tokens=skip))
    assert out.token_ids == [eos] * 3
    assert out.text == llm.tokenizer.decode([eos] * 3, skip_special_tokens=skip)
    assert (out.text == "") is skip
