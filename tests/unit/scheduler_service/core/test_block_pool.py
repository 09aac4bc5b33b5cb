"""BlockPool: LRU free queue, reference counts, cached blocks revived or evicted."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_service.core.block_pool import BlockPool


def test_lru_order_and_reverse_free():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2] and pool.free_block_ids() == [3, 4, 5]
    pool.free_blocks(reversed(a))
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 4, 5, 2]


def test_cached_block_revived_then_evicted():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert pool.cache_full_block(blocks[0], b"h0")
    assert not pool.cache_full_block(blocks[1], b"h0"), "one block per hash"
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(b"h0") is blocks[0] and blocks[0].ref_cnt == 0
    pool.touch([blocks[0]])                              # prefix hit on a free cached block
    assert blocks[0].ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.touch([blocks[0]])                              # a second request shares it
    assert blocks[0].ref_cnt == 2
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([blocks[0]])
    assert pool.free_block_ids() == [2, 1, 0]
    pool.get_new_blocks(2)
    assert pool.get_cached_block(b"h0") is blocks[0]      # 2 and 1 went first
    pool.get_new_blocks(1)
    assert pool.get_cached_block(b"h0") is None and blocks[0].block_hash is None


def test_errors_and_disabled_caching():
    pool = BlockPool(2, enable_caching=False)
    b = pool.get_new_blocks(1)[0]
    assert not pool.cache_full_block(b, b"x") and pool.num_cached_blocks == 0
    pool.cache_full_blocks([b], [b"x"])
    assert b.block_hash is None and pool.num_cached_blocks == 0
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="ref_cnt 0"):
        pool.free_blocks([b])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, enable_caching=True)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / cache / share / free against a simple model of the pool."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(8, enable_caching=True)
        self.owners: list[list] = []          # each owner's blocks, in table order
        self.free_order = list(range(8))      # model of the LRU free queue
        self.hashes: dict[bytes, int] = {}    # model of the hash map

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if n > len(self.free_order):
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            return
        blocks = self.pool.get_new_blocks(n)
        assert [b.block_id for b in blocks] == self.free_order[:n]
        del self.free_order[:n]
        self.hashes = {h: i for h, i in self.hashes.items()
                       if i not in {b.block_id for b in blocks}}
        self.owners.append(blocks)

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), tag=st.integers(0, 5))
    def cache(self, data, tag):
        blocks = data.draw(st.sampled_from(self.owners))
        block = data.draw(st.sampled_from(blocks))
        h = bytes([tag])
        ok = self.pool.cache_full_block(block, h)
        assert ok == (block.block_hash == h and h not in self.hashes)
        if ok:
            self.hashes[h] = block.block_id

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), tags=st.lists(st.integers(0, 5), min_size=1, max_size=4))
    def cache_many(self, data, tags):
        """cache_full_blocks: one block after the other, as cache_full_block would."""
        blocks = data.draw(st.sampled_from(self.owners))[:len(tags)]
        hashes = [bytes([t]) for t in tags]
        expected = {}
        for block, h in zip(blocks, hashes):
            if block.block_hash is None and h not in self.hashes and h not in expected:
                expected[h] = block.block_id
        self.pool.cache_full_blocks(blocks, hashes)
        self.hashes.update(expected)
        for block, h in zip(blocks, hashes):
            if expected.get(h) == block.block_id:
                assert block.block_hash == h

    @precondition(lambda self: self.hashes)
    @rule(data=st.data())
    def share(self, data):
        h = data.draw(st.sampled_from(sorted(self.hashes)))
        block = self.pool.get_cached_block(h)
        assert block.block_id == self.hashes[h]
        if block.ref_cnt == 0:
            self.free_order.remove(block.block_id)
        self.pool.touch([block])
        self.owners.append([block])

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data):
        blocks = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        self.pool.free_blocks(reversed(blocks))
        for b in reversed(blocks):
            if b.ref_cnt == 0:
                self.free_order.append(b.block_id)

    @invariant()
    def consistent(self):
        held: dict[int, int] = {}
        for blocks in self.owners:
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0) >= 0
            # Two owners share a block only through the prefix cache.
            assert b.ref_cnt <= 1 or b.block_hash is not None
        assert self.pool.free_block_ids() == self.free_order
        assert {h: self.pool.get_cached_block(h).block_id for h in self.hashes} == self.hashes
        assert self.pool.num_cached_blocks == len(self.hashes)

    def teardown(self):
        for blocks in self.owners:
            self.pool.free_blocks(reversed(blocks))
        assert self.pool.num_free_blocks == 8
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_churn_queue_is_evicted_first_past_its_cap_and_its_blocks_stay_hittable():
    """Blocks freed with churn=True are handed out before the main queue's only while the churn
    queue holds more than churn_cap; under the cap the main queue's go first, and a cached churn
    block is revived by a hit like any free one."""
    pool = BlockPool(8, enable_caching=True)
    pool.churn_cap = 2
    blocks = pool.get_new_blocks(8)
    pool.free_blocks(blocks[:2])                     # main queue: 0, 1
    pool.cache_full_block(blocks[2], b"h2")
    pool.free_blocks(blocks[2:6], churn=True)        # churn queue: 2, 3, 4, 5
    assert pool.num_free_blocks == 6 and pool.free_block_ids() == [2, 3, 4, 5, 0, 1]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 3]    # 4 over the cap of 2
    assert pool.get_cached_block(b"h2") is None                       # evicted with block 2
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]    # at the cap: main first
    pool.cache_full_block(blocks[6], b"h6")
    pool.free_blocks([blocks[6]], churn=True)
    pool.touch([pool.get_cached_block(b"h6")])                       # a hit out of the churn
    assert blocks[6].ref_cnt == 1 and blocks[6].reused and pool.free_block_ids() == [4, 5]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 5]    # main empty: churn's
    assert not any(b.reused for b in pool.blocks if b.ref_cnt == 1 and b.block_id != 6)
