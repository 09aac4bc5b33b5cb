"""Invariants of the scheduler's KV-cache bookkeeping, checked from the outside after any call.

`check_kv_invariants(sched, gone)` asserts, for a Scheduler and the requests that left it
(finished or aborted):
  * the free queue holds each block at most once, and exactly the blocks nobody holds;
  * every block's ref_cnt is the number of block tables that hold it, and no table holds a
    block twice (free + used == total);
  * the prefix-cache map and the blocks' hashes agree both ways;
  * a block a request holds at position j and that is cached carries that request's own
    chained hash j, salt included (a tenant never holds another salt's cached block);
  * with a sliding window, a table's null places are exactly its leading skipped ones, and only
    blocks no query from the request's computed tokens on can see are skipped;
  * only running requests hold blocks, enough for their computed tokens; nothing is kept for a
    request that left (blocks, hashes, counters), and the leavers are no longer queued;
  * usage and the prefix-hit stats agree with the pool;
  * a hybrid model's window group (hybrid_kv.py) keeps the same per-pool invariants and
    holds the same requests as the full group;
  * at most max_num_seqs run, and at most max_num_seqs + max_waiting are unfinished.
"""
from __future__ import annotations

import hashlib
from collections import Counter

from scheduler_service.core.block_hashes import hash_block
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.sliding_window import num_skipped_blocks


def expected_hashes(request: Request, num_blocks: int, block_size: int) -> list[bytes]:
    """The request's chained block hashes as kv_cache_manager's docstring defines them,
    recomputed here (the salt's root too) rather than with the manager's helpers."""
    tokens = request.prompt_token_ids + request.output_token_ids
    salt = request.cache_salt
    parent = hashlib.blake2b(b"cache-salt:" + salt.encode(), digest_size=16).digest() \
        if salt else None
    out = []
    for j in range(num_blocks):
        parent = hash_block(parent, tokens[j * block_size:(j + 1) * block_size])
        out.append(parent)
    return out


def check_kv_invariants(sched, gone: list[Request] = ()) -> None:
    kv, pool = sched.kv, sched.kv.pool
    live = sched._requests
    running = {r.request_id: r for r in sched.running}
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(not r.status.finished and r.status != RequestStatus.RUNNING
               for r in sched.waiting)
    assert len(running) + len(sched.waiting) == len(live)
    # What the workers may cache (diff_limits.max_cached_requests) rests on these two.
    config = sched.config
    assert len(running) <= config.max_num_seqs
    assert len(live) <= config.max_num_seqs + config.max_waiting
    _check_manager(kv, running, live)
    window = getattr(kv, "window_group", None)      # a hybrid model's second group
    if window is not None:
        _check_manager(window, running, live)
        assert set(window._blocks) == set(kv._blocks), "the groups hold different requests"
    for request in gone:
        assert request.status.finished
        rid = request.request_id
        if live.get(rid) is not request:       # (an id may be reused by a later request)
            assert all(r is not request for r in sched.running)
            assert all(r is not request for r in sched.waiting)
    used = pool.num_blocks - pool.num_free_blocks
    assert abs(sched.kv_cache_usage - used / pool.num_blocks) < 1e-12
    assert 0 <= kv.stats.hits <= kv.stats.queries
    assert 0.0 <= sched.prefix_cache_hit_rate <= 1.0


def _check_manager(kv, running: dict[str, Request], live: dict[str, Request]) -> None:
    """One KV cache manager's pool and tables (a hybrid model's: each group's)."""
    pool, bs = kv.pool, kv.block_size
    free = pool.free_block_ids()
    assert len(free) == len(set(free)), "a block is in the free queue twice"
    tables = kv._blocks
    refs = Counter()
    null = kv.null_block
    for rid, blocks in tables.items():
        ids = [b.block_id for b in blocks if b is not null]
        assert len(ids) == len(set(ids)), f"{rid} holds a block twice: {ids}"
        refs.update(ids)
    for block in pool.blocks:
        assert block.ref_cnt == refs[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs[block.block_id]}")
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert len(free) + len(refs) == pool.num_blocks
    for block_hash, block in pool._cached.items():
        assert block.block_hash == block_hash, f"cached map names block {block.block_id} wrongly"
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool._cached.get(block.block_hash) is block, (
                f"block {block.block_id} has a hash the cache map does not know")
    for rid, blocks in tables.items():
        assert rid in running, f"{rid} holds blocks but is not running"
        request = running[rid]
        assert len(blocks) * bs >= request.num_computed_tokens, f"{rid}: table too short"
        skipped = kv._num_skipped.get(rid, 0)
        assert [b is null for b in blocks] == [j < skipped for j in range(len(blocks))], (
            f"{rid}: null places {[j for j, b in enumerate(blocks) if b is null]}, "
            f"skipped {skipped}")
        assert skipped <= num_skipped_blocks(request.num_computed_tokens, kv.sliding_window,
                                             bs), f"{rid}: a block its window sees was freed"
        num_known = min(len(blocks), request.num_tokens // bs)
        want = expected_hashes(request, num_known, bs)
        for j, block in enumerate(blocks[:num_known]):
            if block is not null and block.block_hash is not None:
                assert block.block_hash == want[j], (
                    f"{rid} holds block {block.block_id} at {j}, cached for other tokens or salt")
    for name in ("_blocks", "_hashes", "_num_cached", "quiet_until", "_num_skipped"):
        assert set(getattr(kv, name)) <= set(live), f"kv.{name} keeps a request that left"
