"""Which KV blocks a request of an all-sliding-window model still needs (vLLM v1's
SlidingWindowManager).

When every attention layer has a window W, the query at position p sees only keys k with
p - W < k <= p. A request that has computed c tokens asks nothing below position c from now on,
so no future query sees a key k <= c - W: its first (c - W + 1) // block_size blocks are never
read again and go back to the pool. Their places in the block table stay (positions are fixed:
block j holds positions j*bs .. j*bs + bs - 1) and hold the null block, which is never handed
out nor freed. The worker is not told: its table keeps the old id at that place, which every
attention backend skips or masks (the window), while the block may already hold another
request's keys.

    block_size 4, W 8, c = 21 computed (queries from position 21 see keys 14..):

    position   0-3    4-7    8-11   12-15  16-19  20-23
    table     [null] [null] [null] [ b9 ] [ b4 ] [ b7 ]      (21 - 8 + 1) // 4 = 3 skipped

A new request's table sent to the workers (admitted with prefix hits, or resumed) carries
NULL_BLOCK_ID at the skipped places: a valid block id, whatever it holds, that no query reads.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from engine_common.configuration.config import SchedulerConfig
from scheduler_service.core.block_pool import BlockHash, KVCacheBlock

# The id the workers see at a skipped place: in range for their checks, never read.
NULL_BLOCK_ID = 0


def new_null_block() -> KVCacheBlock:
    """A manager's own placeholder for skipped places (not in the pool: never freed)."""
    return KVCacheBlock(NULL_BLOCK_ID)


def num_skipped_blocks(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks no query from position `num_computed` on can see (0 without a window)."""
    if not window or num_computed < window:
        return 0
    return (num_computed - window + 1) // block_size


def next_skip_at(num_skipped: int, window: int, block_size: int) -> int:
    """The computed-token count at which block `num_skipped` too is never read again."""
    return (num_skipped + 1) * block_size + window - 1


def num_freed_behind(blocks: Sequence[KVCacheBlock], num_skipped: int, num_computed: int,
                     window: int, block_size: int, taken_back: Collection[int] = ()) -> int:
    """Blocks that go back to the free queue once a request's places no query from
    `num_computed` on sees are freed (its first `num_skipped` places are null already; a block
    another request shares stays held; one whose id() is in `taken_back`, another request's
    prefix hit, leaves the queue again)."""
    end = num_skipped_blocks(num_computed, window, block_size)
    return sum(1 for b in blocks[num_skipped:end] if b.ref_cnt == 1 and id(b) not in taken_back)


def blocks_for_one_chunk(max_chunk: int, window: int, block_size: int) -> int:
    """Blocks a request holds at most while it computes a chunk of up to `max_chunk` tokens:
    the chunk's own and the window's before it, each edge in a partial block. A cache this
    large lets a request alone always advance, however long it gets."""
    return -(-(max_chunk + window) // block_size) + 2


def max_request_len(config: SchedulerConfig, num_blocks: int, sliding_window: int) -> int:
    """Tokens a request may reach: max_model_len, but no more than the whole cache holds, so a
    request alone always fits. With a window every layer has, a request holds only the blocks
    of the window and its chunk: max_model_len once the cache holds that much."""
    if sliding_window and num_blocks >= blocks_for_one_chunk(
            config.max_num_batched_tokens, sliding_window, config.block_size):
        return config.max_model_len
    return min(config.max_model_len, num_blocks * config.block_size)


def longest_window_hit(hashes: Sequence[BlockHash], max_hits: int, window: int,
                       block_size: int, lookup: Callable[[BlockHash], KVCacheBlock | None],
                       null_block: KVCacheBlock) -> list[KVCacheBlock]:
    """The longest prefix hit of at most `max_hits` blocks that a window needs: the blocks the
    first query after it can see must be cached; those below are the null block (they may
    have been evicted). As vLLM's SlidingWindowManager.find_longest_cache_hit: from the longest
    candidate down, a missing block j rules out every hit that would need it, so the next
    candidate ends just before it (each block is looked up at most once)."""
    n = max_hits
    while n > 0:
        first = num_skipped_blocks(n * block_size, window, block_size)
        found = []
        j = n - 1
        while j >= first and (block := lookup(hashes[j])) is not None:
            found.append(block)
            j -= 1
        if j < first:
            found.reverse()
            return [null_block] * first + found
        n = j
    return []


def split_churn(gone: Sequence[KVCacheBlock], first: int, num_prompt: int, window: int,
                block_size: int) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
    """(kept, churn) of the blocks `gone` at places first.. freed behind the window of a request
    with `num_prompt` prompt tokens. Kept (the main LRU queue): those a hit on the same prompt
    needs (its window before the prompt's last whole block) and those a prefix hit once took.
    Churn (the pool's queue evicted first past its cap): the rest, the long run of a prompt
    every request passes through, which in a hybrid model's small window pool would otherwise
    flush the kept blocks of every ended request (block_pool.py)."""
    prompt_hit = (num_prompt - 1) // block_size * block_size      # a repeat's longest hit
    keep_from = num_skipped_blocks(prompt_hit, window, block_size)
    kept, churn = [], []
    for j, block in enumerate(gone, first):
        (kept if j >= keep_from or block.reused else churn).append(block)
    return kept, churn
