"""Freeing the KV blocks a sliding window no longer reaches (sliding_window.py): the blocks a
request holds stay bounded while it decodes, nothing leaks, a prefix hit needs only the
window's blocks, and a request longer than the whole cache completes."""
from __future__ import annotations

import pytest

from scheduler_service.core.admission import RequestRejected
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import RequestStatus
from scheduler_service.core.sliding_window import (NULL_BLOCK_ID, longest_window_hit,
                                                   num_skipped_blocks)
from tests.support.kv_invariants import check_kv_invariants
from tests.support.scheduler_sim import make, make_request, run_steps

BS, W = 4, 8
BOUND = -(-W // BS) + 1          # blocks a decoding request holds at most


def held(sched, request) -> int:
    """Real blocks (not the null places) the request's table holds."""
    return sum(1 for b in sched.kv._blocks.get(request.request_id, ())
               if b is not sched.kv.null_block)


def test_num_skipped_blocks_is_what_no_query_sees():
    # queries from c on see keys > c - W: block j is skipped iff its last key j*bs+3 <= c - W
    for c in range(0, 40):
        want = sum(1 for j in range(20) if j * BS + BS - 1 <= c - W)
        assert num_skipped_blocks(c, W, BS) == want, c
    assert num_skipped_blocks(100, 0, BS) == 0


def test_longest_window_hit_needs_only_the_windows_blocks():
    hashes = [bytes([j]) for j in range(10)]
    null = object()
    cached = {bytes([j]): f"b{j}" for j in (0, 5, 6, 7)}      # 1..4 evicted, 8, 9 missing
    hits = longest_window_hit(hashes, 10, W, BS, cached.get, null)
    # 8 blocks (32 tokens): the first query (32) sees keys 25.. -> blocks 6, 7 needed
    assert hits == [null] * 6 + ["b6", "b7"]
    # block 6 gone too: no hit ending at 7 or 8 blocks; blocks 0 then nothing
    del cached[bytes([6])]
    assert longest_window_hit(hashes, 10, W, BS, cached.get, null) == ["b0"]
    assert longest_window_hit(hashes, 0, W, BS, cached.get, null) == []


def test_decoding_far_past_the_window_holds_a_bounded_number_of_blocks():
    sched, worker = make(num_blocks=64, sliding_window=W, max_num_batched_tokens=16)
    request = make_request("a", range(3, 23), max_tokens=100)
    sched.add_request(request)
    most = []

    def on_step(out, updates):
        check_kv_invariants(sched)
        if request.status == RequestStatus.RUNNING and request.num_output_tokens > 0:
            most.append(held(sched, request))
    run_steps(sched, worker, on_step=on_step)
    assert request.num_output_tokens == 100
    assert max(most) <= BOUND, max(most)          # without freeing: 30 blocks at the end
    assert sched.num_free_blocks == sched.num_total_blocks


def test_block_table_places_stay_and_the_null_id_is_sent_for_skipped_hits():
    sched, worker = make(num_blocks=64, sliding_window=W, max_num_batched_tokens=64)
    first = make_request("a", range(3, 43), max_tokens=1)
    sched.add_request(first)
    run_steps(sched, worker)
    second = make_request("b", list(range(3, 43)) + [7, 8], max_tokens=1)
    sched.add_request(second)
    out = sched.schedule()
    new = out.new_requests[0]
    assert new.num_computed_tokens == 40                   # ten blocks hit
    skipped = num_skipped_blocks(40, W, BS)
    assert skipped == 8 and new.block_ids[:skipped] == [NULL_BLOCK_ID] * skipped
    assert len(new.block_ids) == 11                        # places 0..10: positions kept
    assert held(sched, second) == 3                        # blocks 8, 9 and the new one
    sched.update_from_output(out, worker.execute(out))
    run_steps(sched, worker)
    assert sched.num_free_blocks == sched.num_total_blocks


def test_a_hit_survives_eviction_of_blocks_below_the_window():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True, sliding_window=W)
    first = make_request("a", range(3, 35), max_tokens=1)      # 32 tokens, 8 blocks
    kv.allocate_slots(first, 32)
    first.num_computed_tokens = 32
    kv.free(first)
    # blocks 0..5 of its prefix evicted: 6 and 7 held elsewhere while every free one is taken
    keep = [kv.pool.get_cached_block(kv._block_hashes(first, 8)[j]) for j in (6, 7)]
    kv.pool.touch(keep)
    kv.pool.free_blocks(kv.pool.get_new_blocks(kv.pool.num_free_blocks))
    kv.pool.free_blocks(keep)
    assert kv.pool.num_cached_blocks == 2
    again = make_request("b", list(range(3, 35)) + [9], max_tokens=1)
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 32 and [b is kv.null_block for b in hits] == [True] * 6 + [False] * 2


def test_a_request_longer_than_the_whole_cache_completes():
    """10 blocks hold 40 tokens: without a window the request stops at 40 (length); with it,
    the blocks that left the window are reused and it gets all its 60 tokens."""
    for window, want in ((0, 40 - 20), (W, 60)):
        sched, worker = make(num_blocks=10, sliding_window=window, max_num_batched_tokens=8)
        request = make_request("a", range(3, 23), max_tokens=60)
        sched.add_request(request)
        run_steps(sched, worker, on_step=lambda *_: check_kv_invariants(sched))
        assert request.num_output_tokens == want
        assert sched.num_free_blocks == sched.num_total_blocks


def test_preemption_and_aborts_leak_nothing():
    sched, worker = make(num_blocks=8, sliding_window=W, max_num_batched_tokens=8,
                         max_num_seqs=4)
    requests = [make_request(f"r{i}", range(3 + i, 19 + i), max_tokens=40, seed=i)
                for i in range(4)]
    for r in requests:
        sched.add_request(r)
    start = sched.num_free_blocks
    for _ in range(30):
        out = sched.schedule()
        sched.update_from_output(out, worker.execute(out))
        check_kv_invariants(sched)
    assert any(r.num_preemptions for r in requests)
    sched.finish_requests([requests[0].request_id, requests[1].request_id],
                          RequestStatus.FINISHED_ABORTED)
    check_kv_invariants(sched, requests[:2])
    run_steps(sched, worker, on_step=lambda *_: check_kv_invariants(sched))
    assert all(r.num_output_tokens == 40 for r in requests[2:])
    assert sched.num_free_blocks == start == sched.num_total_blocks


@pytest.mark.parametrize("window", [-1, 1.5, True])
def test_a_bad_window_is_refused_by_name(window):
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(4, BS, True, sliding_window=window)


def test_a_prompt_longer_than_the_whole_cache_is_admitted_and_chunked():
    """60 prompt tokens, 40 in the cache: refused without a window (a prompt must fit the
    cache); with one, prefilled 8 tokens a step, the blocks behind the window reused."""
    sched, worker = make(num_blocks=10, max_num_batched_tokens=8)
    with pytest.raises(RequestRejected, match="prompt tokens"):
        sched.add_request(make_request("a", range(3, 63), max_tokens=4))
    sched, worker = make(num_blocks=10, sliding_window=W, max_num_batched_tokens=8)
    request = make_request("a", range(3, 63), max_tokens=4)
    sched.add_request(request)
    run_steps(sched, worker, on_step=lambda *_: check_kv_invariants(sched))
    assert request.num_output_tokens == 4
    assert sched.num_free_blocks == sched.num_total_blocks


def test_a_long_prefill_never_idles_on_blocks_its_window_left():
    """Two decodes take the free blocks first; the long prefill behind them (80 tokens in
    chunks of 4) counts the blocks it is about to free (those behind its window) as room, so
    it advances in every step it is scheduled instead of idling on them."""
    sched, worker = make(num_blocks=10, sliding_window=W, max_num_batched_tokens=8,
                         long_prefill_token_threshold=4, max_num_seqs=4, max_model_len=200)
    decodes = [make_request(f"d{i}", range(3 + i, 9 + i), max_tokens=120, seed=i)
               for i in range(2)]
    long = make_request("long", range(100, 180), max_tokens=2)
    for r in decodes + [long]:
        sched.add_request(r)
    idle_on_freeable = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if long.status == RequestStatus.RUNNING and long.num_preemptions == 0 \
                and out.num_scheduled_tokens.get(long.handle) == 0 \
                and long.num_computed_tokens < long.num_prompt_tokens:
            freeable = (num_skipped_blocks(long.num_computed_tokens, W, BS)
                        - sched.kv._num_skipped.get("long", 0))
            if freeable > 0:
                idle_on_freeable.append((out.step, long.num_computed_tokens, freeable))
        sched.update_from_output(out, worker.execute(out))
        check_kv_invariants(sched)
    assert long.num_output_tokens == 2 and long.num_preemptions == 0
    assert idle_on_freeable == []
    assert sched.num_free_blocks == sched.num_total_blocks


def test_priority_preemption_counts_the_blocks_the_batch_frees_behind_its_window():
    """The pool is full, but each running decode frees a block behind its window as it is
    scheduled (and takes none): an urgent request needing one block is admitted in that step
    without preempting anybody (priority preemption counted the decodes' growth, not what they
    give back, and preempted one for nothing)."""
    sched, worker = make(num_blocks=6, sliding_window=W, max_num_batched_tokens=16,
                         max_num_seqs=4, max_model_len=200)
    kv = sched.kv
    low = [make_request(f"low{i}", range(3 + i, 9 + i), max_tokens=150, seed=i, priority=1)
           for i in range(2)]
    for r in low:
        sched.add_request(r)

    def frees_and_takes_none(r) -> bool:
        return (num_skipped_blocks(r.num_computed_tokens, W, BS)
                > kv._num_skipped.get(r.request_id, 0) and kv.num_free_blocks_needed(r, 1) == 0)
    for _ in range(300):
        if kv.num_free_blocks == 0 and all(frees_and_takes_none(r) for r in low):
            break
        out = sched.schedule()
        sched.update_from_output(out, worker.execute(out))
    else:
        pytest.fail("no step found where the decodes free blocks and take none")
    urgent = make_request("urgent", [5, 6, 7], max_tokens=2, priority=0)
    sched.add_request(urgent)
    out = sched.schedule()
    assert out.preempted_handles == [] and all(r.status == RequestStatus.RUNNING for r in low)
    assert [n.handle for n in out.new_requests] == [urgent.handle]
    sched.update_from_output(out, worker.execute(out))
    run_steps(sched, worker, on_step=lambda *_: check_kv_invariants(sched))
    assert sched.num_free_blocks == sched.num_total_blocks
