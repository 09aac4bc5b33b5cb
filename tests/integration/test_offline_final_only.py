"""LLM.generate's final-only outputs give the same Completions, field for field, as the same
engine with a per-step OutputProcessor whose outputs are merged: greedy and seeded sampling,
stop strings (text kept token by token), stop ids, min_tokens, logprobs with alternatives, and
requests without stop strings (text decoded once at the finish)."""
from __future__ import annotations

import dataclasses
import random

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
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
    assert all(c.text for c in final) and all(c.logprobs for c in final)
