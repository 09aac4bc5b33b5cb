"""Priority preemption with prefix caching on a real model and a tiny KV cache, against
transformers' greedy tokens: urgent requests arrive mid-run and preempt less urgent ones, which
resume on their own cached blocks (prompt and output) and recompute the rest; one request is
aborted mid-run and its id is reused. Every request that ends must hold transformers' tokens,
and no block may leak."""
from __future__ import annotations

import random

from deltaserve.llm import LLM
from engine_common.request.params import SamplingParams, StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from tests.support.engine_checks import assert_no_leaked_blocks
from tests.support.hf_reference import assert_greedy_agrees, compare_greedy, hf_greedy

MAX_NEW = 10


def test_priority_preemption_with_prefix_hits_matches_transformers(tiny_models):
    model = tiny_models("llama")
    # 14 blocks of 4 tokens (56): each request needs 5-8 blocks by its end.
    llm = LLM(model, dtype="float32", num_kv_blocks=14, block_size=4, max_num_seqs=6,
              max_num_batched_tokens=32)
    rng = random.Random(5)
    vocab = llm.model_info.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(12)]
    engine, sched = llm.engine, llm.scheduler
    prompts, tokens, done = {}, {}, {}
    resumed_hits = []
    orig_schedule = sched.schedule

    def schedule():
        out = orig_schedule()
        resumed_hits.extend(r.num_computed_tokens for r in out.resumed_requests)
        return out
    sched.schedule = schedule

    def add(rid: str, priority: int, tail: int) -> None:
        prompts[rid] = prefix + [rng.randrange(3, vocab) for _ in range(tail)]
        tokens[rid] = []
        engine.add_request(Request(rid, list(prompts[rid]), SamplingParams(),
                                   StoppingParams(max_tokens=MAX_NEW, ignore_eos=True),
                                   llm.model_info.eos_token_ids, priority=priority))

    def run(num_steps: int | None = None) -> None:
        n = 0
        while engine.has_unfinished_requests() and (num_steps is None or n < num_steps):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = (list(tokens[out.request_id]), out.finish_reason)
            n += 1

    for i in range(4):
        add(f"lazy{i}", priority=5, tail=rng.randrange(1, 9))
    run(3)
    for i in range(3):
        add(f"urgent{i}", priority=0, tail=rng.randrange(1, 9))
    run(2)
    engine.abort(["lazy1"])
    done.pop("lazy1", None)
    run(4)
    add("lazy1", priority=5, tail=3)          # the aborted id, reused for a new prompt
    run()

    assert set(done) == set(prompts)
    assert sum(r > 0 for r in resumed_hits) > 0, (
        f"no preempted request resumed on cached blocks: {resumed_hits}")
    near_ties, failures = [], []
    for rid, (got, reason) in sorted(done.items()):
        assert reason == RequestStatus.FINISHED_LENGTH, (rid, reason)
        failure = compare_greedy(f"priority/{rid}", got,
                                 hf_greedy(model, tuple(prompts[rid]), MAX_NEW), near_ties)
        if failure:
            failures.append(failure)
    assert_greedy_agrees(failures, near_ties)
    assert_no_leaked_blocks(llm)
