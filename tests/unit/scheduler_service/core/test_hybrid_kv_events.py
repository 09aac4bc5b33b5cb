"""KV events of a hybrid model (scheduler_service/core/hybrid_kv.py): as vLLM's hybrid
allocator publishes them, each group's blocks are reported, tagged with the group
(BlockStored.group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window; BlockRemoved's
group_idx), so a router indexes only the full-attention group's, the blocks a prefix hit needs
from the start. Replaying the events per group reproduces each pool's cached blocks exactly;
the window group's blocks never enter the full-attention index."""
from __future__ import annotations

import random

import pytest

from engine_common.request.kv_groups import WindowGroup
from scheduler_service.core.block_hashes import hash_block
from scheduler_service.core.kv_events import (FULL_GROUP, AllBlocksCleared, BlockRemoved,
                                              BlockStored, KvEventFeed, KvGroupTag)
from scheduler_service.core.scheduler import Scheduler
from tests.support.scheduler_sim import SimWorker, make, make_request, run_steps

W = 8
WINDOW_GROUP = KvGroupTag(1, "sliding_window", W)


def _replay(events, index: dict[KvGroupTag, set[bytes]], block_size: int) -> None:
    """A router's per-group index (as SMG's: by group_idx and kind); checks each stored
    block's chained hash and that every event names its group."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            for blocks in index.values():
                blocks.clear()
            continue
        assert event.group in (FULL_GROUP, WINDOW_GROUP), event
        blocks = index[event.group]
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                blocks.remove(h)
            continue
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            assert hash_block(parent, event.token_ids[i * block_size:(i + 1) * block_size]) == h
            assert h not in blocks, "a block stored twice in one group without a removal"
            blocks.add(h)
            parent = h


@pytest.mark.parametrize("seed", range(6))
def test_each_group_is_reported_tagged_and_replays_to_its_pool(seed):
    """Shared-prefix prompts longer than the window under pressure in both pools (evictions,
    preemption, churn behind the window): after every step the full-attention index is the
    full pool's cached hashes and the window index the window pool's."""
    rnd = random.Random(seed)
    config = make()[0].config
    feed = KvEventFeed()
    feed.enabled = True
    group = WindowGroup(W, 18)
    sched = Scheduler(config, 40, rng=random.Random(0), kv_events=feed, window_group=group)
    worker = SimWorker(40, config.block_size, window_group=group)
    index = {FULL_GROUP: set(), WINDOW_GROUP: set()}
    kv = sched.kv

    def check(_step=None):
        _replay(feed.take(), index, config.block_size)
        assert index[FULL_GROUP] == set(kv.pool._cached)
        assert index[WINDOW_GROUP] == set(kv.window_group.pool._cached)

    prefixes = [[rnd.randrange(100, 600) for _ in range(rnd.randrange(12, 30))]
                for _ in range(3)]
    for wave in range(4):
        for i in range(rnd.randrange(1, 5)):
            prompt = rnd.choice(prefixes) + [rnd.randrange(100, 600)
                                             for _ in range(rnd.randrange(1, 12))]
            sched.add_request(make_request(f"w{wave}-{i}", prompt,
                                           max_tokens=rnd.randrange(1, 12)))
        run_steps(sched, worker, on_step=lambda *_: check())
        check()
    assert index[WINDOW_GROUP], "the window group's blocks were reported"
    assert sched.kv.reset_prefix_cache()
    check()
    assert not index[FULL_GROUP] and not index[WINDOW_GROUP]


def test_window_blocks_below_the_window_are_never_routable():
    """A 40-token prompt through a window of 8: the window group caches only the blocks its
    window last saw, the full group all ten; a router indexing full_attention events only
    (what SMG's prefix index takes) holds every full block and no event it reads names a block
    only the window group holds."""
    config = make()[0].config
    feed = KvEventFeed()
    feed.enabled = True
    group = WindowGroup(W, 18)
    sched = Scheduler(config, 40, rng=random.Random(0), kv_events=feed, window_group=group)
    worker = SimWorker(40, config.block_size, window_group=group)
    sched.add_request(make_request("a", list(range(100, 140)), max_tokens=1))
    run_steps(sched, worker)
    events = feed.take()
    routable = [e for e in events if isinstance(e, BlockStored) and e.group.kind ==
                "full_attention"]
    assert {h for e in routable for h in e.block_hashes} == set(sched.kv.pool._cached)
    assert len(sched.kv.pool._cached) == 10
    window = [e for e in events if isinstance(e, BlockStored) and e.group == WINDOW_GROUP]
    assert window and all(e.group.sliding_window == W for e in window)


def test_a_model_without_a_window_group_reports_untagged_events():
    """Another model's events are as before: no group (the wire leaves the fields unset)."""
    config = make()[0].config
    feed = KvEventFeed()
    feed.enabled = True
    sched = Scheduler(config, 40, rng=random.Random(0), kv_events=feed)
    sched.add_request(make_request("a", list(range(100, 120)), max_tokens=1))
    run_steps(sched, SimWorker(40, config.block_size))
    stored = [e for e in feed.take() if isinstance(e, BlockStored)]
    assert stored and all(e.group is None for e in stored)
