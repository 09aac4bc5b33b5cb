"""Priority preemption makes room only when the urgent head is then admitted: the running
batch is scheduled first, and the blocks and budget it takes this step (a decode crossing into
a new block, a long prefill's chunk) come before the head. A victim preempted while the head
still did not fit lost its progress for nothing."""
from __future__ import annotations

from tests.support.scheduler_sim import assert_no_leak, make, make_request, run_steps, step
from tests.unit.scheduler_service.core.test_priority import finished_tokens, reference


def test_no_preemption_for_a_block_the_running_batch_takes_first():
    """The running batch is scheduled before admission: a block a less urgent victim frees
    goes first to a running request at least as urgent as the head that needs a new one this
    step. Counting it as room preempted the victim and the head still did not fit."""
    sched, worker = make(num_blocks=4, max_num_seqs=8, max_num_batched_tokens=32)
    grower = make_request("grower", range(10, 18), max_tokens=6, seed=1, priority=0, arrival=0.0)
    victim = make_request("victim", range(20, 23), max_tokens=6, seed=2, priority=1, arrival=1.0)
    sched.add_request(grower)
    sched.add_request(victim)
    step(sched, worker)                # 2 + 1 blocks, 1 free: grower's 9th token takes it
    assert sched.num_free_blocks == 1
    head = make_request("head", range(30, 35), max_tokens=2, seed=3, priority=0, arrival=2.0)
    sched.add_request(head)            # 2 blocks: the free one and the victim's were not enough
    out, _ = step(sched, worker)
    assert not out.preempted_handles and not out.new_requests
    assert out.new_block_ids == {grower.handle: [3]}
    updates = run_steps(sched, worker)
    assert finished_tokens(updates) == reference([grower, victim, head])
    assert_no_leak(sched)


def test_no_preemption_when_the_batch_takes_the_whole_budget_first():
    """A long prefill as urgent as the head takes the threshold (here the whole budget) once
    the less urgent decode is gone: the head would get no token this step."""
    sched, worker = make(num_blocks=5, max_num_seqs=8, max_num_batched_tokens=8,
                         long_prefill_token_threshold=8, max_model_len=64)
    decode = make_request("decode", range(10, 20), max_tokens=9, seed=1, priority=1,
                          arrival=1.0, ignore_eos=True)
    sched.add_request(decode)
    step(sched, worker)
    step(sched, worker)
    long = make_request("long", range(20, 38), max_tokens=2, seed=2, priority=0, arrival=0.0)
    sched.add_request(long)
    step(sched, worker)                # long: 7 of 18 in 2 blocks; decode: 3 blocks; none free
    assert sched.num_free_blocks == 0 and long.num_computed_tokens == 7
    head = make_request("head", [60, 61, 62], max_tokens=2, seed=3, priority=0, arrival=2.0)
    sched.add_request(head)
    out, _ = step(sched, worker)
    assert not out.preempted_handles and not out.new_requests
    updates = run_steps(sched, worker)
    assert finished_tokens(updates) == reference([decode, long, head])
    assert_no_leak(sched)


def test_victims_sharing_a_prefix_free_their_shared_blocks_together():
    """Two less urgent requests share a 2-block prompt prefix: neither alone frees it, both do.
    Counted one victim at a time, their room was 1 + 1 blocks and the head, which needs 5 with
    2 free, was never given the 4 that preempting both frees."""
    sched, worker = make(num_blocks=6, max_num_seqs=8, max_num_batched_tokens=32)
    prefix = list(range(3, 11))
    lazy = [make_request(f"lazy{i}", prefix + [40 + i, 41, 42], max_tokens=3, seed=i,
                         priority=1, arrival=float(i)) for i in range(2)]
    for r in lazy:
        sched.add_request(r)
    step(sched, worker)                # 2 shared + 1 + 1 blocks: 2 free
    assert sched.num_free_blocks == 2
    head = make_request("head", range(60, 80), max_tokens=2, seed=3, priority=0, arrival=5.0)
    sched.add_request(head)
    out, _ = step(sched, worker)
    assert sorted(out.preempted_handles) == sorted(r.handle for r in lazy)
    assert [r.handle for r in out.new_requests] == [head.handle]
    updates = run_steps(sched, worker)
    assert finished_tokens(updates) == reference([*lazy, head])
    assert_no_leak(sched)
