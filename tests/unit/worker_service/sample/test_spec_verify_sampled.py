"""Drafts of sampled requests on a real ModelRunner (tiny qwen3, fp32): each draft is checked
against the draw one-token decoding makes at its position (the row's seed, that token's
counter), so a drafted step returns exactly the tokens of one-token sampled steps; and over
many seeds a draft d is accepted as often as transformers' p(d), as the rejection sampler of a
probability-1 draft must."""
from __future__ import annotations

import math

import pytest
import torch

from engine_common.request.params import SamplingParams
from engine_common.wire.diff import SchedulerOutput, WorkerSamplingParams
from tests.support.garbage_diffs import PROMPT, new
from worker_service.config import RunnerConfig
from worker_service.runner.model_runner import ModelRunner

SAMPLINGS = {
    "t0.7": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=20),
    "top_p": SamplingParams(temperature=0.9, top_p=0.8),
    "min_p": SamplingParams(temperature=1.2, min_p=0.05),
    # the history before each draft position counts: strong penalties change the draw
    "frequency": SamplingParams(temperature=0.8, frequency_penalty=1.5),
    "presence": SamplingParams(temperature=0.7, presence_penalty=1.2),
    "repetition_greedy": SamplingParams(repetition_penalty=1.8),
    "logit_bias": SamplingParams(temperature=0.9, logit_bias=((3, 5.0), (7, 3.0))),
    "allowed": SamplingParams(temperature=1.0, allowed_token_ids=tuple(range(3, 60))),
    # min_tokens 5 with most ids as stop ids: the mask lifts in the middle of the drafts
    "min_tokens": SamplingParams(temperature=0.9),
}
MIN_TOKENS = {"min_tokens": (5, tuple(range(400)))}


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models("qwen3")


def _runner(model: str, rows: int = 4) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model_dir=model, dtype="float32", block_size=4,
                                      max_model_len=64, max_num_seqs=rows,
                                      max_num_batched_tokens=max(64, 8 * rows)))
    runner.init_kv_cache(max(64, 3 * rows))
    return runner


def _sampled_prefill(runner: ModelRunner, sp: SamplingParams, seed: int,
                     min_tokens: tuple = (0, ())) -> int:
    req = new(blocks=list(range(8)), sampling=WorkerSamplingParams(sp, seed, *min_tokens))
    out = runner.execute_diff(SchedulerOutput(0, new_requests=[req],
                                              num_scheduled_tokens={0: len(PROMPT)}))
    return out.sampled_token_ids[0]


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_sampled_drafts_give_the_tokens_of_one_token_steps(model, name):
    sp, seed, min_tokens = SAMPLINGS[name], 1234, MIN_TOKENS.get(name, (0, ()))
    ref = _runner(model)
    first = _sampled_prefill(ref, sp, seed, min_tokens)
    want = [first] + [ref.execute_diff(SchedulerOutput(s)).sampled_token_ids[0]
                      for s in range(1, 9)]
    if name == "min_tokens":        # masked below 5 tokens, sampled freely after
        assert all(t >= 400 for t in want[:5]) and any(t < 400 for t in want[5:]), want
    run = _runner(model)
    assert _sampled_prefill(run, sp, seed, min_tokens) == first
    # Three right drafts, then a wrong one: the three plus the draw at the fourth position.
    wrong = (want[4] + 1) % run.vocab_size
    out = run.execute_diff(SchedulerOutput(1, num_scheduled_tokens={0: 5},
                                           spec_token_ids={0: want[1:4] + [wrong]}))
    assert out.sampled_token_ids == want[1:5]
    # Both right: both kept, and the bonus is drawn with the counter after them.
    out = run.execute_diff(SchedulerOutput(2, num_scheduled_tokens={0: 3},
                                           spec_token_ids={0: want[5:7]}))
    assert out.sampled_token_ids == want[5:8]
    assert run.execute_diff(SchedulerOutput(3)).sampled_token_ids == [want[8]]


def test_a_draft_is_accepted_with_its_probability(model):
    """The draft after PROMPT is the token transformers gives the most probability at
    temperature 0.5; over 448 seeds (fixed: deterministic) it is accepted at a rate within 4.5
    standard deviations of that probability, and a rejected position never yields it."""
    from transformers import AutoModelForCausalLM

    temperature, rows, rounds = 0.5, 64, 7
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1].double()
    p = torch.softmax(logits / temperature, dim=-1)
    draft = int(p.argmax())
    want = float(p[draft])
    run = _runner(model, rows)
    sp, step, accepted, n = SamplingParams(temperature=temperature), 0, 0, 0
    for r in range(rounds):
        handles = range(r * rows, (r + 1) * rows)
        # PROMPT and the draft: 7 slots, two blocks of 4 each
        reqs = [new(h, blocks=[2 * i, 2 * i + 1], sampling=WorkerSamplingParams(sp, seed=h))
                for i, h in enumerate(handles)]
        # Prefill all but the last prompt token: the drafted step then samples after PROMPT.
        run.execute_diff(SchedulerOutput(step, new_requests=reqs,
                                         num_scheduled_tokens={h: len(PROMPT) - 1
                                                               for h in handles},
                                         finished_handles=list(range((r - 1) * rows, r * rows))
                                         if r else []))
        out = run.execute_diff(SchedulerOutput(step + 1,
                                               num_scheduled_tokens={h: 2 for h in handles},
                                               spec_token_ids={h: [draft] for h in handles}))
        step += 2
        firsts = {}
        for h, t in zip(out.handles, out.sampled_token_ids):
            firsts.setdefault(h, t)
        assert sorted(firsts) == list(handles)
        accepted += sum(t == draft for t in firsts.values())
        n += rows
    rate = accepted / n
    bound = 4.5 * math.sqrt(want * (1 - want) / n) + 1 / n
    assert abs(rate - want) <= bound, (rate, want, bound)
