"""The scheduler driven end to end against SimWorker (tests/scheduler_sim.py): every diff goes
through the codec and is applied the way a worker must, and the fake KV cache checks that every
scheduled request reads its own prefix back from its block table. Budgets, chunking, order,
prefix caching, preemption and admission here; a step's results (stops, aborts, handles, the
updates handed on) in test_scheduler_results.py."""
from __future__ import annotations

import random

import pytest

from scheduler_service.core.request import RequestStatus
from scheduler_service.core.scheduler import QueueFull, RequestRejected
from tests.support.scheduler_sim import run_steps
from tests.support.scheduler_sim import assert_no_leak, make, make_request, step


def test_budget_and_max_num_seqs_respected():
    sched, worker = make(max_num_seqs=4, max_num_batched_tokens=16)
    rng = random.Random(3)
    for i in range(10):
        sched.add_request(make_request(f"r{i}", [rng.randrange(3, 99) for _ in range(5 + 3 * i)],
                                       max_tokens=5, seed=i))

    def check(out, _):
        assert 0 < sum(worker.step_tokens[-1].values()) <= 16
        assert len(worker.batch) <= 4 and sched.num_running <= 4
    updates = run_steps(sched, worker, on_step=check)
    assert sum(1 for u in updates if u.finished) == 10
    assert all(u.request.num_output_tokens == 5 for u in updates if u.finished)
    assert_no_leak(sched)


def test_chunked_prefill_diffs():
    sched, worker = make(max_num_seqs=4, max_num_batched_tokens=16)
    req = make_request("a", range(10, 60), max_tokens=2)   # 50 prompt tokens
    sched.add_request(req)
    h = req.handle
    out, ups = step(sched, worker)
    assert [r.handle for r in out.new_requests] == [h]
    assert out.new_requests[0].block_ids == list(range(4)) and out.num_scheduled_tokens == {h: 16}
    assert out.new_requests[0].num_computed_tokens == 0 and ups == []
    for expect_blocks in (4, 4):
        out, ups = step(sched, worker)
        assert out.num_scheduled_tokens == {h: 16} and len(out.new_block_ids[h]) == expect_blocks
        assert ups == [] and not out.new_requests
    out, ups = step(sched, worker)   # last chunk: 2 tokens, one more block, samples
    assert out.num_scheduled_tokens == {h: 2} and len(out.new_block_ids[h]) == 1
    assert len(ups) == 1 and ups[0].new_token_ids == req.output_token_ids
    out, ups = step(sched, worker)   # plain decode: the diff names nothing
    assert out.num_scheduled_tokens == {} and out.new_block_ids == {} and ups[0].finished
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 2
    out, _ = step(sched, worker)
    assert out.finished_handles == [h]
    assert_no_leak(sched)


def test_running_first_then_fcfs_and_priority():
    sched, worker = make(max_num_seqs=4, max_num_batched_tokens=8)
    a, b = make_request("a", [5, 6, 7], max_tokens=20), make_request("b", [8, 9], max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, worker)                       # both prefill in one step (5 tokens)
    late = make_request("late", range(20, 40), priority=0, arrival=2e9)
    urgent = make_request("urgent", range(40, 60), priority=-1, arrival=3e9)
    sched.add_request(late)
    sched.add_request(urgent)
    out, _ = step(sched, worker)
    # a and b decode (1 each) first; the rest of the budget goes to the higher-priority prompt.
    assert [r.handle for r in out.new_requests] == [urgent.handle]
    assert out.num_scheduled_tokens == {urgent.handle: 6}
    assert worker.step_tokens[-1] == {a.handle: 1, b.handle: 1, urgent.handle: 6}
    out, _ = step(sched, worker)
    # Once running, the urgent request is a long prefill (14 tokens left > the threshold, 8):
    # it takes what the decodes leave, not the whole budget (issue 23 item 3: it never starves
    # them); `late`, long too and less urgent, waits for it.
    assert out.num_scheduled_tokens == {urgent.handle: 6}
    assert not out.new_requests
    sched.finish_requests(["a", "b", "late", "urgent"], RequestStatus.FINISHED_ABORTED)
    step(sched, worker)
    assert_no_leak(sched)


def test_prefill_chunk_continues_beside_decodes():
    sched, worker = make(max_num_seqs=2, max_num_batched_tokens=4)
    a = make_request("a", range(3, 15), max_tokens=3)    # 12 tokens: 3 chunks of 4
    b = make_request("b", range(20, 26), max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {a.handle: 4} and len(out.new_requests) == 1
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {a.handle: 4} and not out.new_requests
    out, _ = step(sched, worker)              # a's last chunk fills the budget
    assert out.num_scheduled_tokens == {a.handle: 4}
    out, _ = step(sched, worker)              # a decodes (1); b joins with a 3-token chunk
    assert out.num_scheduled_tokens == {b.handle: 3}
    run_steps(sched, worker)
    assert a.num_output_tokens == b.num_output_tokens == 3
    assert_no_leak(sched)


def test_running_request_without_budget_is_sent_count_zero():
    sched, worker = make(max_num_seqs=2, max_num_batched_tokens=4)
    # b's 4 tokens left after its first chunk are no long prefill (threshold: the budget, 4).
    a, b = make_request("a", [3], max_tokens=3), make_request("b", range(20, 27), max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, worker)              # a: 1 token, b: first 3-token chunk
    assert out.num_scheduled_tokens == {b.handle: 3}
    # White box: put the prefilling request first in batch order, as a resumed or (later)
    # asynchronously scheduled one can be, so it takes the whole budget.
    sched.running.reverse()
    out, ups = step(sched, worker)
    assert out.num_scheduled_tokens == {b.handle: 4, a.handle: 0}
    assert [u.request for u in ups] == [b]          # b samples its first token; a idles
    assert worker.step_tokens[-1] == {b.handle: 4}
    run_steps(sched, worker)
    assert a.num_output_tokens == 3 and b.num_output_tokens == 2
    assert_no_leak(sched)


def test_prefix_cache_hit_on_repeated_and_shared_prefix():
    sched, worker = make()
    shared = list(range(10, 30))             # 20 tokens = 5 full blocks
    first = make_request("first", shared, max_tokens=3)
    sched.add_request(first)
    run_steps(sched, worker)
    assert first.num_cached_tokens == 0
    longer = make_request("longer", shared + [7, 8, 9], max_tokens=3)
    same = make_request("same", shared, max_tokens=3)
    sched.add_request(longer)
    sched.add_request(same)
    out, _ = step(sched, worker)
    new = {r.handle: r for r in out.new_requests}
    assert new[longer.handle].num_computed_tokens == 20
    assert out.num_scheduled_tokens[longer.handle] == 3
    # A whole-prompt hit still recomputes the last token: 4 blocks hit, 4 tokens computed.
    assert new[same.handle].num_computed_tokens == 16
    assert out.num_scheduled_tokens[same.handle] == 4
    assert new[longer.handle].block_ids[:4] == new[same.handle].block_ids[:4]
    assert longer.num_cached_tokens == 20 and same.num_cached_tokens == 16
    assert sched.prefix_cache_hit_rate == pytest.approx(36 / (20 + 23 + 20))
    run_steps(sched, worker)
    assert_no_leak(sched)


def test_prefix_shared_within_one_step_and_disabled_cache():
    for caching in (True, False):
        sched, worker = make(enable_prefix_caching=caching)
        prompt = list(range(50, 62))
        reqs = [make_request(f"r{i}", prompt + [i + 3], max_tokens=4, seed=i) for i in range(3)]
        for r in reqs:
            sched.add_request(r)
        out, _ = step(sched, worker)
        computed = [n.num_computed_tokens for n in out.new_requests]
        assert computed == ([0, 12, 12] if caching else [0, 0, 0])
        run_steps(sched, worker)
        assert_no_leak(sched)


def test_preemption_and_resumption_recompute_same_tokens():
    prompts = [list(range(10, 18)), list(range(30, 38))]
    # Reference: a pool big enough that nobody is preempted.
    ref, ref_worker = make(num_blocks=64)
    for i, p in enumerate(prompts):
        ref.add_request(make_request(f"r{i}", p, max_tokens=12, seed=i))
    ref_out = {u.request.request_id: u.request.output_token_ids
               for u in run_steps(ref, ref_worker) if u.finished}

    sched, worker = make(num_blocks=7)        # 28 tokens for 2 x (8 + 12)
    reqs = [make_request(f"r{i}", p, max_tokens=12, seed=i) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    run_steps(sched, worker)
    diffs = worker.diffs
    pre = [d for d in diffs if d.preempted_handles]
    assert pre and pre[0].preempted_handles == [reqs[1].handle]
    assert not pre[0].new_requests and not pre[0].resumed_requests
    resumed = [d for d in diffs if d.resumed_requests]
    assert resumed and resumed[0].step > pre[0].step
    res = resumed[0].resumed_requests[0]
    assert res.handle == reqs[1].handle
    assert len(res.block_ids) * 4 >= res.num_computed_tokens + resumed[0].num_scheduled_tokens.get(
        res.handle, 1)
    assert reqs[1].num_preemptions >= 1
    assert {r.request_id: r.output_token_ids for r in reqs} == ref_out
    assert_no_leak(sched)


def test_seed_assignment_and_worker_sampling_params():
    sched, worker = make()
    given = make_request("given", [3, 4], seed=1234)
    drawn = make_request("drawn", [3, 4], seed=None, stop_token_ids=(9,), min_tokens=1)
    sched.add_request(given)
    sched.add_request(drawn)
    assert given.seed == 1234 and 0 <= drawn.seed < 2**63
    out, _ = step(sched, worker)
    wsp = {r.handle: r.sampling for r in out.new_requests}
    assert wsp[drawn.handle].seed == drawn.seed and wsp[drawn.handle].min_tokens == 1
    assert wsp[drawn.handle].stop_ids == (2, 9)
    sched.finish_requests(["given", "drawn"], RequestStatus.FINISHED_ABORTED)


def test_rejections():
    sched, _ = make(num_blocks=4, max_model_len=32, max_waiting=2)
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        sched.add_request(make_request("empty", []))
    with pytest.raises(RequestRejected, match="max_model_len"):
        sched.add_request(make_request("long", range(30), max_tokens=3))
    with pytest.raises(RequestRejected, match="max_model_len"):
        sched.add_request(make_request("nolimit", range(32), max_tokens=None))
    # min_tokens bounded by the room alone (the worker refuses a step carrying 2**31)
    with pytest.raises(RequestRejected, match=r"min_tokens=2147483648 must be <= 22 "):
        sched.add_request(make_request("least", range(10), max_tokens=None, min_tokens=2**31))
    with pytest.raises(RequestRejected, match="KV-cache capacity"):
        sched.add_request(make_request("big", range(17), max_tokens=1))
    with pytest.raises(RequestRejected, match="token ids"):
        sched.add_request(make_request("neg", [3, -1]))
    sched.add_request(make_request("ok1", [1]))
    with pytest.raises(RequestRejected, match="request_id"):
        sched.add_request(make_request("ok1", [1]))
    sched.add_request(make_request("ok2", [1]))
    with pytest.raises(QueueFull) as err:
        sched.add_request(make_request("ok3", [1]))
    assert isinstance(err.value, RequestRejected) and err.value.field == "waiting requests"
    assert sched.num_waiting == 2
    with pytest.raises(ValueError):
        sched.finish_requests("ok1", RequestStatus.RUNNING)


def test_admission_names_an_id_out_of_uint32_and_keeps_the_prompt_bytes():
    from array import array
    sched, _ = make(num_blocks=8, max_model_len=32)
    for bad, ids in ((-1, [3, -1, 5]), (2**32, [3, 2**32, 5])):
        with pytest.raises(RequestRejected, match=rf"prompt_token_ids={bad} .*\[0, 4294967295\]"):
            sched.add_request(make_request(f"bad{bad}", ids))
    ok = make_request("ok", [0, 7, 2**32 - 1])
    sched.add_request(ok)
    assert ok.prompt_u32 == array("I", [0, 7, 2**32 - 1]).tobytes()


def test_random_workload_no_leak_and_consistent_diffs():
    rng = random.Random(11)
    sched, worker = make(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=12)
    ids = []
    for i in range(12):
        prefix = [7, 7, 7, 7] if i % 2 else []
        prompt = prefix + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 14))]
        req = make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 10), seed=i,
                           priority=rng.randrange(2))
        sched.add_request(req)
        ids.append(req.request_id)

    def maybe_abort(out, _):
        if out.step % 7 == 3:
            sched.finish_requests([rng.choice(ids)], RequestStatus.FINISHED_ABORTED)
    run_steps(sched, worker, on_step=maybe_abort)
    step(sched, worker)
    assert_no_leak(sched)
    assert worker.reqs == {}


def test_readmission_after_preemption_leaves_the_prefix_cache_counts_alone():
    """The counts are of prompt tokens at a request's first admission (docs/metrics.md, vLLM's
    prefix_cache_queries/hits): a preempted request that is readmitted and hits its own blocks
    (prompt and output) would otherwise report recompute as cache hits."""
    prompts = [list(range(10, 18)), list(range(30, 38))]     # no shared prefix
    sched, worker = make(num_blocks=7)
    reqs = [make_request(f"r{i}", p, max_tokens=12, seed=i) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    run_steps(sched, worker)
    assert reqs[1].num_preemptions >= 1
    resumed = [res for d in worker.diffs for res in d.resumed_requests]
    assert any(res.num_computed_tokens > 0 for res in resumed), "no self-hit on resumption"
    assert (sched.kv.stats.queries, sched.kv.stats.hits) == (16, 0)
    assert sched.prefix_cache_hit_rate == 0.0


def test_a_tenant_never_hits_another_salts_cached_blocks():
    """Same prompt under two salts (api_keys.py gives one per key): each salt finds only its own
    cached blocks, so a tenant's cached-token count says nothing of another's prompts; the
    unsalted cache is a third namespace."""
    sched, worker = make()
    prompt = list(range(10, 30))              # 5 full blocks

    def run(rid, salt):
        request = make_request(rid, prompt, max_tokens=2)
        request.cache_salt = salt
        sched.add_request(request)
        run_steps(sched, worker)
        return request
    a1 = run("a1", "key:a")
    b1, plain = run("b1", "key:b"), run("plain", "")
    a2, b2 = run("a2", "key:a"), run("b2", "key:b")
    assert [r.num_cached_tokens for r in (a1, b1, plain)] == [0, 0, 0]
    assert a2.num_cached_tokens == b2.num_cached_tokens == 16
    new = [n for d in worker.diffs for n in d.new_requests]     # a1 b1 plain a2 b2
    assert [n.num_computed_tokens for n in new] == [0, 0, 0, 16, 16]
    assert new[3].block_ids[:4] == new[0].block_ids[:4]
    assert new[4].block_ids[:4] == new[1].block_ids[:4]
    assert not set(new[3].block_ids[:4]) & set(new[4].block_ids[:4])
    assert_no_leak(sched)
