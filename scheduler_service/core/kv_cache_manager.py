"""Per-request block tables on top of the block pool, with prefix caching of full blocks.

Block hashes are chained so a block's hash names its whole prefix:

    hash_j = blake2b(hash_{j-1} || uint32 token ids of block j)
    hash_{-1} = b"" without a salt, else blake2b("cache-salt:" || request.cache_salt)

The salt (one per API key, api/api_keys.py) enters the first block's hash and so every later
one: a request finds only blocks cached by requests of its own salt (vLLM's cache_salt).

Only full blocks whose tokens are all known are hashed and cached. They are cached as soon as
they are scheduled to be computed (the step is assumed to run), so a request admitted later in
the same step may already share them: the attention backends write a step's keys/values for the
whole batch before attending.

With a sliding window on every attention layer (`sliding_window`), the blocks that fell out of
the window go back to the pool as a request advances, their places taken by a null block, and a
prefix hit needs only the blocks the window still sees (sliding_window.py). A freed block keeps
its hash until the pool hands it out again, so it may still be hit.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from engine_common.request.pooling import needs_every_position
from scheduler_service.core.block_pool import BlockHash, BlockPool, KVCacheBlock
from scheduler_service.core.block_hashes import append_chained, block_namespace, salt_root
from scheduler_service.core.kv_events import KvEventFeed
from scheduler_service.core.request import Request
from scheduler_service.core.sliding_window import (longest_window_hit, new_null_block,
                                                   next_skip_at, num_freed_behind,
                                                   num_skipped_blocks, split_churn)


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output without concatenating the whole sequence."""
    prompt, out = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return out[start - p:end - p]
    return prompt[start:] + out[:end - p]


def _lowest_query(request: Request) -> int:
    """The lowest position a running request's next step's queries may start at, which a
    window frees blocks by: tokens in flight (async scheduling) count as computed, and drafts
    among them may be rejected."""
    return request.num_computed_tokens - request.num_pending_tokens


def _num_free(blocks: Sequence[KVCacheBlock]) -> int:
    """Blocks among `blocks` in the free queue (none to count without prefix hits; the null
    block's ref_cnt stays 0 but it is never in the free queue: callers pass live hits only)."""
    return sum(1 for b in blocks if b.ref_cnt == 0) if blocks else 0


@dataclass
class PrefixCacheStats:
    """Counted at a request's first admission: prompt tokens looked up and tokens hit. A
    readmission after preemption is not counted (its hits are its own blocks: recompute, not
    reuse), as vLLM's prefix_cache_queries/hits leave preempted requests out."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates and frees the blocks of each request; finds and records cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 events: KvEventFeed | None = None, sliding_window: int = 0):
        """`events`, when given, records the blocks the prefix cache stores and evicts.
        `sliding_window`: the window every attention layer has (0: some layer sees every key);
        blocks no query can see any more are then freed (sliding_window.py)."""
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
                or sliding_window < 0:
            raise ValueError(f"sliding_window={sliding_window!r} is invalid: must be an "
                             "integer >= 0 (0: no window on some layer)")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.null_block = new_null_block()          # at the places of freed blocks
        self._num_skipped: dict[str, int] = {}      # leading places holding the null block
        self.enable_caching = enable_caching
        self.events = events
        self.pool = BlockPool(num_blocks, enable_caching, events)
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}   # hashes of the request's full blocks
        self._num_cached: dict[str, int] = {}          # leading blocks already offered to cache
        # request id -> computed + new tokens up to which allocate_slots (without prefix hits)
        # would change nothing: no new block, no block to cache. Callers may skip it below that.
        self.quiet_until: dict[str, int] = {}
        # Blocks freed behind the window go to the pool's churn queue (split_churn): a hybrid
        # model's small window pool then keeps ended requests' tails, not every passing run.
        self.evict_behind_first = False

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self._blocks.get(request.request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens, in whole blocks, never covering the
        last token (it must be computed to sample). Returns (blocks, number of tokens).
        None for a request that wants prompt logprobs: every prompt position must be computed
        (as vLLM v1's get_computed_blocks); its blocks are still offered to the cache."""
        if (not self.enable_caching or request.num_prompt_logprobs is not None
                or needs_every_position(request.pooling)):     # MEAN, CLS pooling: the same
            return [], 0
        max_hits = (request.num_tokens - 1) // self.block_size
        if self.sliding_window:       # only the blocks the window sees must be cached
            hits = longest_window_hit(self._block_hashes(request, max_hits), max_hits,
                                      self.sliding_window, self.block_size,
                                      self.pool.get_cached_block, self.null_block)
            return hits, len(hits) * self.block_size
        hits = []
        for block_hash in self._block_hashes(request, max_hits)[:max_hits]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()
                       ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` after the request's computed tokens (and after the
        prefix hit `new_computed_blocks`, only for a request that holds no blocks yet).
        Returns the freshly allocated blocks, or None (nothing changed) when too few are free."""
        rid = request.request_id
        held = self._blocks.get(rid)
        if held and not new_computed_blocks:
            new_ids = self.grow_slots(request, num_new_tokens)
            return None if new_ids is None else held[len(held) - len(new_ids):]
        new_blocks = self._allocate_first(request, held or [], num_new_tokens,
                                          new_computed_blocks)
        if new_blocks is not None:
            self._set_quiet_until(rid, len(self._blocks[rid]), self._num_cached.get(rid, 0))
        return new_blocks

    def grow_slots(self, request: Request, num_new_tokens: int,
                   free_skipped: bool = True) -> list[int] | None:
        """allocate_slots for a request that holds blocks and gets no prefix hit (a running
        request after its first step), kept lean for the scheduler's hot loop. Returns the ids
        of the blocks appended ([] when none), or None when too few are free (nothing changed
        but, with a window, blocks no query sees any more are freed first). The blocks that
        became full are offered to the prefix cache. The request's num_computed_tokens must be
        where this step's queries start: a caller that advanced it already (draft tokens after
        the step's own) passes free_skipped=False."""
        rid, bs = request.request_id, self.block_size
        held = self._blocks[rid]
        if self.sliding_window and free_skipped:
            self._free_skipped(request, held, _lowest_query(request))
        total = request.num_computed_tokens + num_new_tokens
        need = -(-total // bs) - len(held)
        new_ids = []
        if need > 0:
            if need > self.pool.num_free_blocks:
                return None
            new_blocks = self.pool.get_new_blocks(need)
            held += new_blocks
            new_ids = [b.block_id for b in new_blocks]
        limit = len(held) * bs               # quiet_until, as _set_quiet_until computes it
        if self.enable_caching:
            num_cached = self._num_cached.get(rid, 0)
            # min(total, num_tokens) // bs full blocks get cached; never more than total // bs.
            if total // bs > num_cached:
                num_full = min(total, len(request.prompt_token_ids)
                               + len(request.output_token_ids)) // bs
                if num_full > num_cached:
                    hashes = self._block_hashes(request, num_full)
                    # (a null block's place, below the window, is never offered)
                    for j in range(max(num_cached, self._num_skipped.get(rid, 0)), num_full):
                        self._cache_block(request, held[j], hashes, j)
                    self._num_cached[rid] = num_cached = num_full
            limit = min(limit, (num_cached + 1) * bs - 1)
        if self.sliding_window:
            limit = min(limit, next_skip_at(self._num_skipped.get(rid, 0),
                                            self.sliding_window, bs))
        self.quiet_until[rid] = limit
        return new_ids

    def _set_quiet_until(self, rid: str, num_held: int, num_cached: int) -> None:
        """grow_slots changes nothing for a total of T tokens while T fits the held blocks,
        (with caching) T // block_size does not pass the blocks already offered to the cache
        and (with a window) T does not reach the count that frees one more block."""
        limit = num_held * self.block_size
        if self.enable_caching:
            limit = min(limit, (num_cached + 1) * self.block_size - 1)
        if self.sliding_window:    # grow_slots frees the next block once computed reaches it
            limit = min(limit, next_skip_at(self._num_skipped.get(rid, 0),
                                            self.sliding_window, self.block_size))
        self.quiet_until[rid] = limit

    def _allocate_first(self, request: Request, held: list[KVCacheBlock], num_new_tokens: int,
                        new_computed_blocks: Sequence[KVCacheBlock]) -> list[KVCacheBlock] | None:
        """allocate_slots in general: a request's first blocks, with or without prefix hits."""
        rid = request.request_id
        if new_computed_blocks and held:
            raise ValueError(f"request {rid}: prefix hits given to a request that holds blocks")
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        need = self._num_new_blocks(request, num_new_tokens, len(new_computed_blocks))
        skip = self._num_skipped_hits(request, new_computed_blocks)
        live_hits = new_computed_blocks[skip:]
        if need + _num_free(live_hits) > self.pool.num_free_blocks:
            return None       # (num_free_blocks_needed, its block count reused)
        if self.enable_caching and not held and request.num_computed_tokens == 0 \
                and request.num_preemptions == 0:      # a readmission's hits are recompute
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens
        self.pool.touch(live_hits)
        blocks = self._blocks.setdefault(rid, held)
        if skip:          # hits no query will see: their places hold the null block
            blocks.extend([self.null_block] * skip)
            self._num_skipped[rid] = skip
        blocks.extend(live_hits)
        new_blocks = self.pool.get_new_blocks(need)
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, min(total, request.num_tokens) // self.block_size)
        return new_blocks

    def num_free_blocks_needed(self, request: Request, num_new_tokens: int,
                               new_computed_blocks: Sequence[KVCacheBlock] = ()) -> int:
        """Free-queue blocks `allocate_slots` with these arguments would take: the new blocks,
        plus hit blocks that sit in the free queue (they leave it too)."""
        skip = self._num_skipped_hits(request, new_computed_blocks)
        return (self._num_new_blocks(request, num_new_tokens, len(new_computed_blocks))
                + _num_free(new_computed_blocks[skip:]))

    def _num_skipped_hits(self, request: Request, hits: Sequence[KVCacheBlock]) -> int:
        """Leading prefix hits no query of the request will see (0 without a window)."""
        if not hits or not self.sliding_window:
            return 0
        return min(len(hits), num_skipped_blocks(
            request.num_computed_tokens + len(hits) * self.block_size, self.sliding_window,
            self.block_size))

    def _free_skipped(self, request: Request, held: list[KVCacheBlock], num_computed: int) -> None:
        """Free the request's blocks that no query from position num_computed on can see;
        their places take the null block. The later ones join the free queue first (evicted
        first), as free() orders a whole table; with evict_behind_first, those no hit at the
        prompt's end needs and never hit join the pool's churn queue instead."""
        rid = request.request_id
        start = self._num_skipped.get(rid, 0)
        end = min(len(held), num_skipped_blocks(num_computed, self.sliding_window,
                                                self.block_size))
        if end <= start:
            return
        gone = held[start:end]
        held[start:end] = [self.null_block] * (end - start)
        self._num_skipped[rid] = end
        if not self.evict_behind_first:
            self.pool.free_blocks(reversed(gone))
            return
        kept, churn = split_churn(gone, start, len(request.prompt_token_ids),
                                  self.sliding_window, self.block_size)
        self.pool.free_blocks(reversed(kept))
        self.pool.free_blocks(reversed(churn), churn=True)

    def _num_new_blocks(self, request: Request, num_new_tokens: int, num_hit_blocks: int) -> int:
        held = len(self._blocks.get(request.request_id, ()))
        total = (request.num_computed_tokens + num_hit_blocks * self.block_size
                 + num_new_tokens)
        return max(0, -(-total // self.block_size) - held - num_hit_blocks)

    def num_fitting_tokens(self, request: Request) -> int:
        """New tokens a running request's held blocks, those it frees first (num_freed_by_window)
        and the free queue hold together."""
        free = self.pool.num_free_blocks + self.num_freed_by_window(request)
        held = len(self._blocks.get(request.request_id, ()))
        return (held + free) * self.block_size - request.num_computed_tokens

    def grow_fitting(self, request: Request, num_new_tokens: int) -> list[int]:
        """grow_slots for at most num_fitting_tokens(request) tokens, which the free blocks
        hold, so it never returns None; a caller past that broke the contract, and scheduling
        the tokens anyway (a None read as "no new blocks") would send them without KV blocks
        to write to: RuntimeError, nothing changed."""
        new_ids = self.grow_slots(request, num_new_tokens)
        if new_ids is None:
            raise RuntimeError(
                f"KV cache: {num_new_tokens} new tokens of {request.request_id} do not fit (at "
                f"most num_fitting_tokens={self.num_fitting_tokens(request)}); the caller must "
                "ask within it")
        return new_ids

    def num_freed_by_window(self, request: Request, taken_back: Collection[int] = ()) -> int:
        """Blocks behind the request's window its next grow_slots returns to the free queue
        (0 without a window), but those whose id() is in `taken_back` (another's prefix hits)."""
        rid = request.request_id
        return self.sliding_window and num_freed_behind(
            self._blocks.get(rid, ()), self._num_skipped.get(rid, 0), _lowest_query(request),
            self.sliding_window, self.block_size, taken_back)

    def freed_blocks_counter(self, taken_back: Sequence[KVCacheBlock] = ()
                             ) -> Callable[[Request], int]:
        """A counter for requests freed one after another (preemption victims): each call
        returns how many more blocks would return to the free queue once that request is freed
        too. A block the requests share returns with the last of them that holds it; blocks in
        `taken_back` (another request's prefix hits, which would leave the free queue again as
        it is admitted) never count."""
        taken = {id(b) for b in taken_back}
        holders: dict[int, int] = {}
        null = self.null_block

        def add(request: Request) -> int:
            freed = 0
            for block in self._blocks.get(request.request_id, ()):
                if block is null:
                    continue
                key = id(block)
                holders[key] = n = holders.get(key, 0) + 1
                if n == block.ref_cnt and key not in taken:
                    freed += 1
            return freed
        return add

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first. Safe to call for a request holding none."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, [])
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        self.quiet_until.pop(rid, None)
        skipped = self._num_skipped.pop(rid, 0)       # the leading null places
        self.pool.free_blocks(reversed(blocks[skipped:]))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _block_hashes(self, request: Request, num_full: int) -> list[BlockHash]:
        """The request's chained block hashes, extended to at least `num_full` blocks."""
        hashes = self._hashes.setdefault(request.request_id, [])
        start, bs = len(hashes), self.block_size
        if num_full <= start:
            return hashes
        # hash_block's digests from one uint32 buffer of all the new blocks' tokens (a new
        # prompt hashes dozens of blocks: no per-block list slice and array).
        prompt_u32 = request.prompt_u32          # made at admission, when it was
        if prompt_u32 is not None and num_full * bs <= len(request.prompt_token_ids):
            data = prompt_u32[start * bs * 4:num_full * bs * 4]
        else:
            data = array("I", _token_slice(request, start * bs, num_full * bs)).tobytes()
        parent = (hashes[-1] if start else salt_root(request.prefix_salt)) or b""
        append_chained(hashes, parent, data, 4 * bs)
        return hashes

    def _cache_full_blocks(self, request: Request, num_full: int) -> int:
        """Offer the request's first `num_full` blocks to the cache (those not offered yet);
        returns how many are offered now."""
        rid = request.request_id
        start = self._num_cached.get(rid, 0)
        if not self.enable_caching or num_full <= start:
            return start
        hashes = self._block_hashes(request, num_full)
        blocks = self._blocks[rid]
        start = max(start, self._num_skipped.get(rid, 0))     # never a null block's place
        if self.events is not None and self.events.enabled:
            for j in range(start, num_full):
                self._cache_block(request, blocks[j], hashes, j)
        else:       # nobody listens: no need to know which blocks entered the cache
            self.pool.cache_full_blocks(blocks[start:num_full], hashes[start:num_full])
        self._num_cached[rid] = num_full
        return num_full

    def _cache_block(self, request: Request, block: KVCacheBlock, hashes: list[BlockHash],
                     j: int) -> None:
        """Offer the request's full block j (hash hashes[j]) to the prefix cache; record it
        when it enters the cache and someone listens."""
        if self.pool.cache_full_block(block, hashes[j]) and self.events is not None \
                and self.events.enabled:
            bs = self.block_size
            self.events.stored(hashes[j], hashes[j - 1] if j else None,
                               _token_slice(request, j * bs, (j + 1) * bs), bs,
                               block_namespace(request))
