"""KV-cache events: the feed's coalescing and gating, and the events the block pool and the KV
manager record. The property that matters to a router: replaying the events reproduces exactly
the set of blocks the prefix cache holds, and every stored block's token ids hash (chained with
its parent) to its block hash."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core.block_pool import BlockPool
from scheduler_service.core.block_hashes import hash_block, salt_root
from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.kv_events import (AllBlocksCleared, BlockNamespace, BlockRemoved,
                                              BlockStored, KvEventFeed)
from scheduler_service.core.scheduler import Scheduler
from tests.support.scheduler_sim import SimWorker, make, make_request, run_steps

H = [bytes([i]) * 16 for i in range(8)]


def enabled_feed() -> KvEventFeed:
    feed = KvEventFeed()
    feed.enabled = True
    return feed


def test_consecutive_stores_of_one_chain_coalesce():
    feed = enabled_feed()
    feed.stored(H[1], None, [1, 2], 2)
    feed.stored(H[2], H[1], [3, 4], 2)
    feed.stored(H[5], H[3], [9, 9], 2)          # another chain: a new event
    feed.removed(H[0])
    feed.removed(H[4])
    assert feed.take() == [BlockStored([H[1], H[2]], None, [1, 2, 3, 4], 2),
                           BlockStored([H[5]], H[3], [9, 9], 2),
                           BlockRemoved([H[0], H[4]])]
    assert feed.take() == []


def test_a_removal_between_stores_keeps_the_order():
    feed = enabled_feed()
    feed.stored(H[1], None, [1], 1)
    feed.removed(H[1])
    feed.stored(H[1], None, [1], 1)
    assert [type(e) for e in feed.take()] == [BlockStored, BlockRemoved, BlockStored]


def test_cleared_drops_what_was_not_taken():
    feed = enabled_feed()
    feed.stored(H[1], None, [1], 1)
    feed.cleared()
    feed.removed(H[2])
    assert feed.take() == [AllBlocksCleared(), BlockRemoved([H[2]])]


def test_a_disabled_feed_records_nothing():
    feed = KvEventFeed()
    feed.stored(H[1], None, [1], 1)
    feed.removed(H[1])
    feed.cleared()
    assert feed.take() == []
    feed.enabled = True
    feed.stored(H[1], None, [1], 1)
    feed.enabled = False             # the last subscriber left before the engine took them
    assert feed.take() == []


def test_pool_records_evictions_resets_and_its_own_creation():
    feed = enabled_feed()
    pool = BlockPool(4, enable_caching=True, events=feed)
    assert feed.take() == [AllBlocksCleared()]      # a new pool is an empty cache
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, H[1]) and pool.cache_full_block(b, H[2])
    pool.free_blocks([b, a])
    assert feed.take() == []                         # freeing keeps the contents cached
    pool.get_new_blocks(3)                           # two uncached blocks, then b (H[2])
    assert feed.take() == [BlockRemoved([H[2]])]
    pool2 = BlockPool(2, enable_caching=True, events=feed)
    feed.take()
    pool2.reset_prefix_cache()
    assert feed.take() == [AllBlocksCleared()]


def test_manager_records_stored_chains_with_their_tokens():
    feed = enabled_feed()
    kv = KVCacheManager(16, 4, enable_caching=True, events=feed)
    feed.take()
    req = make_request("r", list(range(10, 21)))     # 11 tokens: two full blocks of 4
    assert kv.allocate_slots(req, 11) is not None
    (event,) = feed.take()
    h0 = hash_block(None, [10, 11, 12, 13])
    assert event == BlockStored([h0, hash_block(h0, [14, 15, 16, 17])], None,
                                list(range(10, 18)), 4)


def test_stored_blocks_name_their_adapter_and_salt():
    """Two adapters' (and the base model's) blocks of the same tokens: different hashes, and
    events that say why (vLLM's lora_id / lora_name; the salt as its digest), so a router that
    hashes token ids itself can keep them apart. Blocks of two namespaces never coalesce."""
    feed = enabled_feed()
    kv = KVCacheManager(32, 4, enable_caching=True, events=feed)
    feed.take()
    tokens = list(range(10, 19))                     # two full blocks of 4
    reqs = [make_request("base", tokens), make_request("salted", tokens),
            make_request("sql", tokens), make_request("chat", tokens)]
    reqs[1].cache_salt = "key:team-a"
    for r, (lora_id, generation, name) in zip(reqs[2:], [(1, 3, "sql"), (2, 4, "chat")]):
        r.lora_id, r.lora_generation, r.lora_name = lora_id, generation, name
    for r in reqs:
        assert kv.allocate_slots(r, 9) is not None
    events = feed.take()
    assert [e.namespace for e in events] == [
        BlockNamespace(), BlockNamespace(cache_salt=salt_root("key:team-a").hex()),
        BlockNamespace(3, "sql"), BlockNamespace(4, "chat")]
    assert "team-a" not in events[1].namespace.cache_salt      # a digest, not the salt
    assert len({e.block_hashes[0] for e in events}) == 4
    assert all(len(e.block_hashes) == 2 and e.token_ids == tokens[:8] for e in events)


def test_manager_without_a_feed_or_caching_records_nothing():
    feed = enabled_feed()
    kv = KVCacheManager(16, 4, enable_caching=False, events=feed)
    feed.take()
    assert kv.allocate_slots(make_request("r", list(range(9))), 9) is not None
    assert feed.take() == []
    plain = KVCacheManager(16, 4, enable_caching=True)
    assert plain.allocate_slots(make_request("r", list(range(9))), 9) is not None


def _replay(events, index: dict[bytes, tuple[bytes | None, list[int]]], block_size: int) -> None:
    """What a router's index does with the events; checks each stored block's hash."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            index.clear()
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                del index[h]
        else:
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                tokens = event.token_ids[i * block_size:(i + 1) * block_size]
                assert hash_block(parent, tokens) == h
                assert h not in index, "a block stored twice without a removal in between"
                index[h] = (parent, tokens)
                parent = h


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 40))
def test_replaying_the_events_reproduces_the_prefix_cache(seed, num_blocks):
    """Random shared-prefix workloads under cache pressure (evictions, preemption): after every
    step the replayed index holds exactly the pool's cached hashes."""
    rnd = random.Random(seed)
    config = make()[0].config
    feed = enabled_feed()
    sched = Scheduler(config, num_blocks, rng=random.Random(0), kv_events=feed)
    worker = SimWorker(num_blocks, config.block_size)
    index: dict[bytes, tuple[bytes | None, list[int]]] = {}
    prefixes = [[rnd.randrange(100, 600) for _ in range(rnd.randrange(4, 24))] for _ in range(3)]

    def check(_step=None):
        _replay(feed.take(), index, sched.config.block_size)
        assert set(index) == set(sched.kv.pool._cached)

    for wave in range(4):
        for i in range(rnd.randrange(1, 6)):
            prompt = rnd.choice(prefixes) + [rnd.randrange(100, 600)
                                             for _ in range(rnd.randrange(1, 12))]
            sched.add_request(make_request(f"w{wave}-{i}", prompt,
                                           max_tokens=rnd.randrange(1, 12)))
        run_steps(sched, worker, on_step=lambda *_: check())
        check()
