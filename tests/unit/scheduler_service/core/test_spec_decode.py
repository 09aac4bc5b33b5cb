"""Speculative decoding in the scheduler, against a worker that verifies drafts greedily
(tests/support/spec_sim.py): the same tokens as one-token decoding, rollback of rejected drafts,
stop rules inside an accepted run, KV blocks and the prefix cache."""
from __future__ import annotations

import json

import pytest

from engine_common.configuration.config import SchedulerConfig
from engine_common.request.params import ParamError, SamplingParams, StoppingParams
from scheduler_service.core.request import Request, RequestStatus
from tests.support.scheduler_sim import assert_no_leak, make, make_request, run_steps
from tests.support.spec_sim import SpecSimWorker, periodic_sample

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1})


def _run(requests, spec: bool, sample_fn, num_blocks=64, **cfg):
    """Every request's output tokens and finish status; the scheduler and worker."""
    sched, plain = make(num_blocks=num_blocks, sample_fn=sample_fn,
                        speculative_config=SPEC if spec else None, **cfg)
    worker = SpecSimWorker(num_blocks, sched.config.block_size, sample_fn=sample_fn,
                           window=cfg.get("sliding_window", 0))
    reqs = [make_request(rid, prompt, **kw) for rid, prompt, kw in requests]
    for r in reqs:
        sched.add_request(r)
    run_steps(sched, worker)
    assert_no_leak(sched)
    return [(r.output_token_ids, r.status) for r in reqs], sched, worker


def _requests(n=8, max_tokens=30):
    return [(f"r{i}", [10 + i, 20 + i, 30 + i, 10 + i, 20 + i][:2 + i % 4] + [7] * (i % 3),
             {"max_tokens": max_tokens, "seed": i}) for i in range(n)]


@pytest.mark.parametrize("noise", [0, 5, 7])
def test_same_tokens_as_one_token_decoding(noise):
    sample = periodic_sample(3, noise)
    want, _, _ = _run(_requests(), False, sample)
    got, sched, worker = _run(_requests(), True, sample)
    assert got == want
    stats = sched.spec.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    if noise:      # some drafts rejected: rolled back, and the tokens are still the same
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert max(n for step in worker.produced for n in step.values()) > 1
    assert len(worker.diffs) < len(_run(_requests(), False, sample)[2].diffs)


@pytest.mark.parametrize("max_tokens", range(1, 14))
def test_max_tokens_cuts_an_accepted_run(max_tokens):
    sample = periodic_sample(3)
    reqs = [("a", [11, 12, 13, 11, 12, 13], {"max_tokens": max_tokens})]
    want, _, _ = _run(reqs, False, sample)
    got, sched, worker = _run(reqs, True, sample)
    assert got == want and len(got[0][0]) == max_tokens
    assert got[0][1] == RequestStatus.FINISHED_LENGTH
    # drafts never ask past max_tokens: the last step produced exactly what was left
    for diff in worker.diffs:
        for h, d in diff.spec_token_ids.items():
            assert len(d) <= max_tokens - 1


def test_stop_id_inside_an_accepted_run():
    sample = periodic_sample(4)
    prompt = [11, 12, 13, 14, 11, 12, 13, 14]
    free, _, _ = _run([("a", prompt, {"max_tokens": 20})], False, sample)
    stop = free[0][0][6]           # a token late in a fully accepted run of 4 drafts
    reqs = [("a", prompt, {"max_tokens": 20, "stop_token_ids": (stop,)})]
    want, _, _ = _run(reqs, False, sample)
    got, sched, worker = _run(reqs, True, sample)
    assert got == want
    assert got[0][1] == RequestStatus.FINISHED_STOP_TOKEN and got[0][0][-1] == stop
    assert len(got[0][0]) < 20
    # the step that stopped produced tokens past the stop id, which were dropped
    assert sum(n for step in worker.produced for n in step.values()) > len(got[0][0])


def test_updates_carry_every_accepted_token_in_order():
    sched, _ = make(sample_fn=periodic_sample(3), speculative_config=SPEC)
    worker = SpecSimWorker(64, 4, sample_fn=periodic_sample(3))
    req = make_request("a", [11, 12, 13, 11, 12, 13], max_tokens=25)
    sched.add_request(req)
    updates = run_steps(sched, worker)
    streamed = [t for u in updates for t in u.new_token_ids]
    assert streamed == req.output_token_ids
    assert any(len(u.new_token_ids) > 1 for u in updates)
    assert all(len(u.new_logprobs) == len(u.new_token_ids) for u in updates)


def test_prefix_cache_never_holds_a_rejected_draft():
    # Noise makes drafts fail mid-block; later requests whose prompts are the earlier ones'
    # whole sequences hit their cached blocks, and the sim checks every KV slot they read.
    sample = periodic_sample(3, 4)
    sched, _ = make(num_blocks=96, sample_fn=sample, speculative_config=SPEC)
    worker = SpecSimWorker(96, 4, sample_fn=sample)
    first = [make_request(f"a{i}", [40 + i, 41, 42, 40 + i, 41], max_tokens=24, seed=i)
             for i in range(3)]
    for r in first:
        sched.add_request(r)
    run_steps(sched, worker)
    assert sched.spec.stats.num_accepted_tokens < sched.spec.stats.num_draft_tokens
    second = [make_request(f"b{i}", r.prompt_token_ids + r.output_token_ids, max_tokens=10,
                           seed=i) for i, r in enumerate(first)]
    for r in second:
        sched.add_request(r)
    run_steps(sched, worker)
    assert all(r.num_cached_tokens > 0 for r in second)
    assert_no_leak(sched)


def test_preemption_under_a_small_pool_and_chunked_prefill():
    sample = periodic_sample(3, 7)
    reqs = [(f"r{i}", list(range(50 + i, 50 + i + 9)) * 2, {"max_tokens": 30, "seed": i})
            for i in range(6)]
    kw = {"num_blocks": 40, "max_num_batched_tokens": 16}
    want, _, _ = _run(reqs, False, sample, **kw)
    got, sched, worker = _run(reqs, True, sample, **kw)
    assert got == want
    assert any(d.preempted_handles for d in worker.diffs), "the pool should force preemption"
    assert sched.spec.stats.num_accepted_tokens > 0


def test_drafts_and_rollbacks_with_a_sliding_window():
    """Every layer with a window of 8: the blocks behind it are freed from a pool smaller than
    the requests, never one a draft's verification or a rollback still reads (the sim reads
    from each step's first query's window on); the same tokens as one-token decoding."""
    sample = periodic_sample(3, 7)
    reqs = [(f"r{i}", list(range(50 + i, 50 + i + 9)) * 2, {"max_tokens": 60, "seed": i})
            for i in range(4)]
    kw = {"num_blocks": 10, "max_num_batched_tokens": 16, "sliding_window": 8,
          "max_model_len": 96}
    want, _, _ = _run(reqs, False, sample, **kw)
    got, sched, worker = _run(reqs, True, sample, **kw)
    assert got == want and all(len(out) == 60 for out, _ in got)     # 78 tokens > 40 held
    assert sched.spec.stats.num_accepted_tokens < sched.spec.stats.num_draft_tokens


def test_budget_and_max_len_bound_the_drafts():
    sample = periodic_sample(2)
    got, sched, worker = _run([(f"r{i}", [5 + i, 6, 5 + i, 6], {"max_tokens": None})
                               for i in range(8)], True, sample, max_model_len=40)
    for d, tokens in zip(worker.diffs, worker.step_tokens):
        assert sum(tokens.values()) <= 32
    assert all(len(out) == 36 for out, _ in got)


def test_top_logprob_requests_draft():
    """Every request may draft now, top alternatives too (the workers return them for every
    token of an accepted run): the same tokens as one-token decoding, drafted."""
    sample = periodic_sample(3)
    tops = _requests(n=3)
    want, _, _ = _run(tops, False, sample)
    sched, _ = make(num_blocks=64, sample_fn=sample, speculative_config=SPEC)
    worker = SpecSimWorker(64, sched.config.block_size, sample_fn=sample)
    reqs = [make_request(rid, prompt, **kw) for rid, prompt, kw in tops]
    for r in reqs:
        r.num_logprobs = 2
        sched.add_request(r)
    run_steps(sched, worker)
    assert_no_leak(sched)
    assert [(r.output_token_ids, r.status) for r in reqs] == want
    assert any(diff.spec_token_ids for diff in worker.diffs)


@pytest.mark.parametrize("spec, key", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config.method"),
    ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 99}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
     '"prompt_lookup_max": 2}', "speculative_config.prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookup": 1}',
     "speculative_config.lookup"),
    ('not json', "speculative_config"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}',
     "speculative_config.disable_by_batch_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 2.5}',
     "speculative_config.disable_by_batch_size"),
])
def test_config_errors_name_the_key(spec, key):
    with pytest.raises(ParamError) as e:
        SchedulerConfig(max_model_len=64, speculative_config=spec)
    assert e.value.field == key


def test_config_defaults_and_async_allowed():
    c = SchedulerConfig(max_model_len=64, speculative_config='{"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_min": 2}').speculative
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 2, 2)
    assert SchedulerConfig(max_model_len=64).speculative is None
    both = SchedulerConfig(max_model_len=64, speculative_config=SPEC, async_scheduling=True)
    assert both.async_scheduling and both.speculative.num_speculative_tokens == 4


def _spec_with_batch_limit(limit: int) -> str:
    return json.dumps({**json.loads(SPEC), "disable_by_batch_size": limit})


@pytest.mark.parametrize("limit, drafts", [(8, True), (7, False)])
def test_disable_by_batch_size(limit, drafts):
    """Eight requests decode side by side: a limit of 8 still drafts, 7 drafts in no step of
    all eight (and in the end, as requests finish and the batch shrinks, it may); the tokens
    stay those of one-token decoding either way."""
    sample = periodic_sample(3)
    want, _, _ = _run(_requests(max_tokens=12), False, sample)
    sched, _ = make(num_blocks=64, sample_fn=sample,
                    speculative_config=_spec_with_batch_limit(limit))
    assert sched.config.speculative.disable_by_batch_size == limit
    worker = SpecSimWorker(64, sched.config.block_size, sample_fn=sample)
    reqs = [make_request(rid, prompt, **kw) for rid, prompt, kw in _requests(max_tokens=12)]
    for r in reqs:
        sched.add_request(r)
    run_steps(sched, worker)
    assert_no_leak(sched)
    assert [(r.output_token_ids, r.status) for r in reqs] == want
    full_steps = [step for step in worker.produced if len(step) == 8]
    assert full_steps
    assert any(max(step.values()) > 1 for step in full_steps) == drafts
