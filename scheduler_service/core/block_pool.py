"""The pool of KV-cache blocks: reference counts, an LRU free queue and the prefix-cache map.

Free queue (LRU; blocks are handed out from the head, freed blocks join at the tail):

    head (evicted / handed out first)                              tail (freed last)
      |                                                               |
      v                                                               v
    [b7 hash=-] <-> [b3 hash=ab..] <-> [b9 hash=-] <-> ... <-> [b2 hash=cd..]

    cached: {ab..: b3, cd..: b2, ...}   every block with a hash, free (ref_cnt 0) or in use

A free block that still has a hash keeps its KV contents: a prefix hit revives it (takes it out
of the middle of the queue). Its hash is dropped only when the block is handed out as a fresh
block. A request's blocks [b0 b1 b2] are freed as b2, b1, b0, so the tail of a sequence (the part
least likely to be shared) is evicted before its prefix.

A second free queue, the churn queue, takes the blocks freed with churn=True (a hybrid model's
window group frees there the blocks a request leaves behind its window): it is evicted first
while it holds more than churn_cap blocks, else the main queue is (an empty one: the other).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_service.core.kv_events import KvEventFeed

BlockHash = bytes


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block. ref_cnt counts the requests whose block table holds it."""

    block_id: int
    ref_cnt: int = 0
    # Hash of the block's tokens chained with its prefix; None until the block is full and cached.
    block_hash: BlockHash | None = None
    # Whether a prefix hit took it since it was last handed out fresh (proven worth keeping).
    reused: bool = False


class BlockPool:
    """Owns every block; hands out fresh ones, revives cached ones, takes freed ones back."""

    def __init__(self, num_blocks: int, enable_caching: bool, events: KvEventFeed | None = None):
        """`events`, when given, records evictions and resets (a new pool is an empty cache)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} is invalid: must be an integer >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in LRU order (first = head).
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        # A second free queue for blocks freed with churn=True (a window group's blocks behind
        # the window): evicted first while it holds more than churn_cap blocks, so a stream of
        # them cannot flush the blocks of the main queue, yet the last churn_cap stay cached.
        self._churn: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.churn_cap = num_blocks
        self.events = events
        if events is not None:
            events.cleared()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they can be evicted)."""
        return len(self._free) + len(self._churn)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queues, the churn queue's then the main one's, each head first (for tests
        and debugging)."""
        return list(self._churn) + list(self._free)

    def _pop_free(self) -> tuple[int, KVCacheBlock]:
        """The next (id, block) to hand out: the churn queue's oldest while it is over its cap
        (or the main queue is empty), else the main queue's least recently freed."""
        churn = self._churn
        if churn and (len(churn) > self.churn_cap or not self._free):
            return churn.popitem(last=False)
        return self._free.popitem(last=False)

    def get_new_blocks(self, num: int) -> list[KVCacheBlock]:
        """Take `num` blocks from the head of the free queue, evicting their cached contents."""
        if num > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num} blocks: only {self.num_free_blocks} free")
        # A prefill step takes ~1000 blocks: the eviction inline, the lookups hoisted.
        out = []
        popitem, churn, cached, events = self._free.popitem, self._churn, self._cached, self.events
        for _ in range(num):
            block = (self._pop_free() if churn else popitem(last=False))[1]
            block_hash = block.block_hash
            if block_hash is not None:
                if cached.get(block_hash) is block:
                    del cached[block_hash]
                    if events is not None:
                        events.removed(block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            block.reused = False
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (prefix hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if self._free.pop(block.block_id, None) is None:
                    del self._churn[block.block_id]
            block.ref_cnt += 1
            block.reused = True

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a block that just became full. Returns False (block stays uncached) when
        caching is off or another block already holds the same contents."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def cache_full_blocks(self, blocks: Iterable[KVCacheBlock],
                          block_hashes: Iterable[BlockHash]) -> None:
        """cache_full_block for each block and its hash, in one loop (a new prompt's dozens of
        blocks; for callers that need not know which ones entered the cache)."""
        if not self.enable_caching:
            return
        cached = self._cached
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], churn: bool = False) -> None:
        """Drop one reference on each block; blocks reaching zero join the free-queue tail in the
        given order (so the first given is evicted first); with `churn`, the churn queue's."""
        free = self._churn if churn else self._free
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
