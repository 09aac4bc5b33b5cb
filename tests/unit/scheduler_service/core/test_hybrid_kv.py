"""The hybrid KV cache (scheduler_service/core/hybrid_kv.py) driven by the scheduler against
SimWorker, whose fake caches check that every position a full layer and a windowed layer read
holds the right prefix (so a block freed too early, reused while read, or a wrong window table
fails): long requests, preemption, prefix hits, aborts; both pools whole afterwards."""
from __future__ import annotations

import pytest

from engine_common.request.kv_groups import WindowGroup, window_pool_bound
from engine_common.wire.codec import decode_scheduler_output, encode_scheduler_output
from engine_common.wire.diff import SchedulerOutput
from scheduler_service.core.hybrid_kv import HybridKVCacheManager
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.request import RequestStatus
from tests.support.scheduler_sim import make, make_request, run_steps

W, BS = 8, 4


def _group(num_blocks: int) -> WindowGroup:
    return WindowGroup(W, num_blocks)


def _assert_whole(sched) -> None:
    kv = sched.kv
    assert isinstance(kv, HybridKVCacheManager)
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.window_group.num_free_blocks == kv.window_group.num_total_blocks
    assert not kv.window_ids and not kv._blocks and not kv.window_group._blocks


def test_long_requests_hold_the_whole_context_in_full_and_the_window_in_window_group():
    """Two requests of 100 tokens each: the full group holds every block of each, the window
    group never more than the window and a chunk's blocks per request (the pool has 20)."""
    sched, worker = make(num_blocks=64, window_group=_group(20), max_num_seqs=2,
                         max_num_batched_tokens=8, max_model_len=128, enable_prefix_caching=False)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", range(10 + i, 70 + i), max_tokens=40,
                                       ignore_eos=True))
    full_held, window_held = [], []

    def on_step(out, updates):
        full_held.append(sched.kv.num_total_blocks - sched.kv.num_free_blocks)
        window_held.append(sched.kv.window_group.num_total_blocks
                           - sched.kv.window_group.num_free_blocks)

    updates = run_steps(sched, worker, on_step=on_step)
    assert sum(1 for u in updates if u.finished) == 2
    assert max(full_held) >= 2 * (92 // BS)               # (nearly) both whole contexts
    per_request = -(-(W + 8) // BS) + 2                   # blocks_for_one_chunk
    assert max(window_held) <= 2 * per_request < max(full_held)
    assert any(out.new_window_block_ids for out in worker.diffs)
    _assert_whole(sched)


def test_preemption_frees_and_refills_both_groups():
    """A full group too small for three requests at once: requests are preempted, resume with
    fresh tables in both groups, and every read is right."""
    sched, worker = make(num_blocks=40, window_group=_group(30), max_num_seqs=3,
                         max_num_batched_tokens=16, max_model_len=128, enable_prefix_caching=False)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", range(20 * i, 20 * i + 30), max_tokens=30,
                                       ignore_eos=True))
    run_steps(sched, worker)
    assert any(out.preempted_handles for out in worker.diffs)
    assert any(out.resumed_requests for out in worker.diffs)
    _assert_whole(sched)


def test_prefix_hit_holds_in_both_groups():
    """The same 40-token prompt again: a hit of whole blocks in the full group whose window
    blocks the window group still caches; the reads through both tables are right."""
    sched, worker = make(num_blocks=64, window_group=_group(30), max_num_seqs=2,
                         max_num_batched_tokens=16, max_model_len=128, enable_prefix_caching=True)
    prompt = list(range(50, 90))
    sched.add_request(make_request("a", prompt, max_tokens=4, ignore_eos=True))
    run_steps(sched, worker)
    sched.add_request(make_request("b", prompt + [7, 8], max_tokens=4, ignore_eos=True))
    run_steps(sched, worker)
    new = [r for out in worker.diffs for r in out.new_requests]
    assert new[-1].num_computed_tokens == 40             # ten blocks of four
    assert worker.diffs[0].new_window_block_ids          # the first diff sent a's table
    _assert_whole(sched)


def _hit_after(others: list[list[int]], prompt: list[int]) -> tuple[int, int]:
    """(hit both groups hold, the full group's own hit) for `prompt` + [1] after `prompt` ran,
    then each of `others` one after another, through a window pool of 12 blocks."""
    sched, worker = make(num_blocks=200, window_group=_group(12), max_num_seqs=1,
                         max_num_batched_tokens=8, max_model_len=128, enable_prefix_caching=True)
    sched.add_request(make_request("a", prompt, max_tokens=2, ignore_eos=True))
    run_steps(sched, worker)
    for i, other in enumerate(others):
        sched.add_request(make_request(f"x{i}", other, max_tokens=2, ignore_eos=True))
        run_steps(sched, worker)
    _, num_hit = sched.kv.get_computed_blocks(make_request("b", prompt + [1], max_tokens=2))
    full_only = KVCacheManager.get_computed_blocks(
        sched.kv, make_request("c", prompt + [1], max_tokens=2))[1]
    sched.add_request(make_request("b", prompt + [1], max_tokens=2, ignore_eos=True))
    run_steps(sched, worker)                              # the reads check the hit
    _assert_whole(sched)
    return num_hit, full_only


def test_a_long_request_passing_through_the_window_pool_keeps_an_ended_prompts_tail():
    """An 80-token request after a 40-token prompt takes twice the window pool's 12 blocks, but
    those it frees behind its window are evicted before the ended prompt's tail: the prompt
    repeated still hits all 40 tokens, as one pool would (the blocks freed behind the window
    once took the LRU place of the tail, and the hit was lost)."""
    num_hit, full_only = _hit_after([list(range(300, 380))], list(range(50, 90)))
    assert num_hit == full_only == 40


def test_prefix_hit_is_cut_where_the_window_group_lost_its_blocks():
    """The tails of five more ended requests evict the prompt's tail from the window pool: the
    hit is cut to what both groups hold, here nothing."""
    others = [list(range(300 + 20 * i, 316 + 20 * i)) for i in range(5)]
    num_hit, full_only = _hit_after(others, list(range(50, 90)))
    assert full_only == 40 and num_hit < full_only


def test_blocks_once_hit_outlive_the_churn_behind_the_window():
    """A shared 24-token system prompt hit by a second request, both with 40-token questions:
    the system prompt's blocks, freed behind the window as a later request passes them, keep
    their LRU place (they were hit), so a third request after a long unrelated one hits them."""
    system = list(range(500, 524))
    sched, worker = make(num_blocks=200, window_group=_group(20), max_num_seqs=1,
                         max_num_batched_tokens=8, max_model_len=128, enable_prefix_caching=True)
    for i, tail in enumerate([range(600, 640), range(700, 740), range(300, 380)]):
        prompt = list(tail) if i == 2 else system + list(tail)
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=2, ignore_eos=True))
        run_steps(sched, worker)
    _, num_hit = sched.kv.get_computed_blocks(make_request("q", system + [9] * 40, max_tokens=2))
    assert num_hit == 24
    _assert_whole(sched)


def test_aborts_leave_both_pools_whole():
    sched, worker = make(num_blocks=64, window_group=_group(24), max_num_seqs=4,
                         max_num_batched_tokens=8, max_model_len=128)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", range(5 * i, 5 * i + 40), max_tokens=50,
                                       ignore_eos=True))
    for _ in range(12):
        out = sched.schedule()
        sched.update_from_output(out, worker.execute(out))
    assert sched.kv.window_group.num_free_blocks < 24
    sched.finish_requests([f"r{i}" for i in range(4)], RequestStatus.FINISHED_ABORTED)
    _assert_whole(sched)


def test_window_ids_on_the_wire_and_absent_for_other_models():
    """new_window_block_ids survives the codec; a diff without them encodes as before (seven
    fields, no trailing ones)."""
    import msgpack

    out = SchedulerOutput(step=3, new_window_block_ids={1: [4, 5, 6], 7: [0, 0, 9]})
    assert decode_scheduler_output(encode_scheduler_output(out)) == out
    plain = SchedulerOutput(step=3, new_block_ids={1: [2]})
    assert len(msgpack.unpackb(encode_scheduler_output(plain))) == 7


@pytest.mark.parametrize("seqs,tokens,expected", [(4, 16, 4 * 5 + 8), (256, 2048, 256 * 5 + 1024)])
def test_window_pool_bound(seqs, tokens, expected):
    assert window_pool_bound(W, BS, seqs, tokens) == expected


def test_workers_window_groups_agree_or_init_is_refused():
    from scheduler_service.workers.init_messages import shared_window_group

    assert shared_window_group([(0, 0), (0, 0)]) is None
    assert shared_window_group([(8, 30), (8, 28)]) == WindowGroup(8, 28)     # the smallest
    with pytest.raises(ValueError, match=r"workers disagree on the hybrid KV cache's window "
                                         r"group: \(window, blocks\) \[\(8, 30\), \(0, 0\)\]"):
        shared_window_group([(8, 30), (0, 0)])
